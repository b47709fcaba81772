"""Export a trained drafter in SpecForge's layout (what ``vllm-dspark inspect`` accepts).

One BF16 ``model.safetensors`` without ``embed_tokens`` / ``lm_head`` (the
drafter borrows the target's) and a SpecForge-style ``config.json``: the
fields of :meth:`DSparkConfig.to_hf_dict` plus the token ids and ``auto_map``
that SpecForge writes, as in the Kimi-K3 export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_dspark.checkpoint import save_checkpoint, validate_checkpoint
from vllm_dspark.model.reference import DSparkDraftModel


def export_drafter(model: DSparkDraftModel, out_dir: Path, *, bos_token_id: int,
                   eos_token_id: int, pad_token_id: int) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (bf16) and validate the result."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    extra = {
        "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    path = save_checkpoint(out_dir, model.config, state, dtype=torch.bfloat16, extra_config=extra)
    # save_checkpoint stages in a private temp dir; ship ordinary permissions.
    Path(path).chmod(0o755)
    for f in Path(path).iterdir():
        f.chmod(0o644)
    # Keys sorted, as SpecForge's export writes them.
    cfg_path = Path(path) / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()), indent=2, sort_keys=True) + "\n")
    report = validate_checkpoint(path)
    if not report.ok:
        raise RuntimeError(f"exported drafter at {path} does not validate: {report.problems}")
    return path
