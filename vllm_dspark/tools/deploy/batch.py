"""Offline batch generation over a JSONL file of prompts, resumable, optionally data-parallel on Ray.

Used by ``scripts/batch_generate.py`` (see ``docs/deployment.md``).

Input: one JSON object per line, each read on its own (the formats and their checks are in
``vllm_dspark/tools/deploy/batch_formats.py``):

* ``{"id": ..., "prompt": "text"}``: sent as it is; with ``--apply-chat-template``, as one user
  turn through the target's chat template;
* ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}``: rendered with the
  target tokenizer's chat template (``add_generation_prompt=True``), as ``vllm``'s chat does;
* ``{"id": ..., "prompt_token_ids": [1, 2, 3]}``: sent as they are;
* the OpenAI batch request ``vllm run-batch`` reads: ``{"custom_id": "r1", "method": "POST",
  "url": "/v1/chat/completions" (or "/v1/completions"), "body": {"messages": [...], "max_tokens": 64}}``.

A simple line's ``id`` is any JSON scalar, unique in the file (a missing id becomes
``line-<n>``, n the 1-based line number), and an optional ``sampling`` object overrides the
command-line sampling for that line (``{"max_tokens": 64}``). An OpenAI request's id is its
``custom_id`` (a string, unique in the file), and its body's sampling fields (``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ...)
override the command line's. A file holds either OpenAI requests or simple lines. Every line
is checked before any engine starts (and each line still to generate has its sampling fields
built and its chat rendered); a bad one stops the run with its line number and what to fix.

Output: one JSON object per finished prompt, in completion order. For simple lines::

    {"id": ..., "text": ..., "token_ids": [...], "finish_reason": "length",
     "prompt_tokens": 12, "completion_tokens": 256}

for OpenAI requests, the line ``vllm run-batch`` writes::

    {"id": "batch_req_...", "custom_id": "r1", "error": null, "response": {"status_code": 200,
     "request_id": ..., "body": {"object": "chat.completion", "choices": [{"message": {"role":
     "assistant", "content": ...}, "finish_reason": ...}], "usage": {...}, ...}}}

(plus ``"replica": k`` in data-parallel mode). Each result is appended and
flushed the moment its request finishes (the loop drives the ``LLM``'s engine
the way ``LLM.generate`` does, but writes each request as it completes instead
of waiting for the whole batch), and fsynced at least once a second.

Resume: a rerun with the same output file skips every id (``custom_id``) already in it. A
crash can leave at most one torn last line (a record written only in part); it
is cut off, and its prompt is generated again. A malformed line anywhere else
means the file was edited or is not ours: the run stops and says which line.
Sampled runs (temperature > 0) seed each request from ``--seed`` and its id,
so a redone prompt gets the same tokens it would have got the first time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dspark.tools.deploy.batch_formats import (
    OPENAI,
    BatchInputError,
    check_family,
    id_key,
    is_openai_result,
    needs_template,
    openai_result,
    parse_line,
    read_chat_template,
    render_chats,
    result_id,
)

# Environment the driver passes on to data-parallel replicas (per-node ones excluded).
FORWARD_ENV_PREFIXES = ("VLLM_", "OMP_", "NCCL_", "HF_", "TRANSFORMERS_", "RAY_")
PER_NODE_ENV = {"VLLM_HOST_IP", "CUDA_VISIBLE_DEVICES", "RAY_ADDRESS"}


# ------------------------------------------------------------------------- input / output files
def read_prompts(path: str | Path) -> list[dict]:
    """Parse and check every line of the prompts JSONL; every problem names the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise BatchInputError(f"prompts file {path}: not found")
    records: list[dict] = []
    seen: dict[str, int] = {}
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BatchInputError(f"{path}:{n}: not valid JSON ({exc})") from None
            rec = parse_line(obj, n, f"{path}:{n}")
            if records:
                check_family(records[0], rec, f"{path}:{n}")
            key = id_key(rec["id"])
            if key in seen:
                name = "custom_id" if rec["family"] == OPENAI else "id"
                raise BatchInputError(f"{path}:{n}: {name} {rec['id']!r} already used on line {seen[key]}; "
                                      f"{name}s must be unique (results are matched to prompts by {name})")
            seen[key] = n
            records.append(rec)
    return records


def load_done(path: str | Path, *, repair: bool = True) -> tuple[dict[str, dict], str | None]:
    """Results already in ``path``: ``({id_key of its id (custom_id for OpenAI results): record}, note)``.

    A torn last line (no newline, or not JSON) is cut off when ``repair`` is
    true; ``note`` then says so. A bad line before the last one raises.
    """
    path = Path(path)
    if not path.exists():
        return {}, None
    data = path.read_bytes()
    body, newline, tail = data.rpartition(b"\n")
    lines = body.split(b"\n") if newline else []
    if not newline:
        tail = data
    done: dict[str, dict] = {}
    note = None
    good_end = 0  # byte offset just past the last good line

    def torn(nbytes: int) -> str:
        return (f"{path}: cut off a torn last line ({nbytes} bytes, left by an interrupted run); "
                "its prompt will be generated again")

    for n, raw in enumerate(lines, 1):
        if raw.strip():
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError:
                obj = None
            if not (isinstance(obj, dict) and "id" in obj):
                if n == len(lines) and not tail.strip():
                    note = torn(len(raw) + 1)  # a newline-terminated but incomplete last record
                    break
                raise BatchInputError(f"{path}:{n}: not a result record; the results file was edited or is "
                                      "not from this script. Fix or remove that line, or write to a new file")
            done.setdefault(id_key(result_id(obj)), obj)
        good_end += len(raw) + 1
    else:
        if tail.strip():
            note = torn(len(tail))
    if note and repair:
        with path.open("r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done, note


class BatchOutputError(RuntimeError):
    """The results file cannot be written; the message names the file, the cause and the fix."""


_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
         errno.EFBIG: "the file is larger than this file system allows"}
_READ_ONLY = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
              errno.EPERM: "operation not permitted"}


def output_error(path: str | Path, exc: OSError, kept: int | None = None) -> BatchOutputError:
    """One message for a results file that cannot be written: which file, why, what is kept, the fix."""
    path = Path(path)
    code = exc.errno
    if code in _FULL:
        why = _FULL[code]
        fix = (f"free space on the disk holding {path.parent} (or pass another --output), then rerun the "
               "same command: the results already written are skipped")
    elif code in _READ_ONLY:
        why = _READ_ONLY[code]
        fix = (f"make {path if path.exists() else path.parent} writable (or pass --output on a writable "
               "disk), then rerun the same command")
    else:
        why = exc.strerror or str(exc)
        fix = "fix the cause, then rerun the same command: the results already written are skipped"
    kept_note = ""
    if kept is not None and path.exists():
        kept_note = f" Every result written before is intact in it ({kept} from this run)."
    return BatchOutputError(f"cannot write results to {path}: {why} ([Errno {code}]).{kept_note} To go on: {fix}.")


_write = os.write  # the one call that puts result bytes on disk (tests inject disk-full errors here)


class ResultWriter:
    """Append-only JSONL writer: one ``write`` per record, straight to the file, fsynced once a second.

    A record that cannot be written whole (disk full, file system gone read-only) is cut off
    again where possible, so the file keeps only complete lines (a crash can still tear the
    last one; ``load_done`` repairs that), and :class:`BatchOutputError` says what happened.
    """

    def __init__(self, path: str | Path, fsync_interval: float = 1.0):
        self.path = Path(path)
        self.written = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise output_error(self.path, exc) from None
        self._fsync_interval = fsync_interval
        self._last_sync = time.monotonic()

    def _fail(self, exc: OSError, size: int) -> BatchOutputError:
        assert self._fd is not None  # only called from write(), which checked it
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, size)  # drop the part of the line that did get written
        return output_error(self.path, exc, kept=self.written)

    def write(self, record: dict) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: the results file is closed")
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:  # unbuffered: nothing is left in a buffer to fail again at close
                n = _write(self._fd, view)
                view = view[n:]
            if time.monotonic() - self._last_sync >= self._fsync_interval:
                os.fsync(self._fd)
                self._last_sync = time.monotonic()
        except OSError as exc:
            raise self._fail(exc, size) from None
        self.written += 1

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as exc:
            raise output_error(self.path, exc, kept=self.written) from None
        finally:
            os.close(fd)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the first error is the one to report
            with contextlib.suppress(BatchOutputError):
                self.close()


# ------------------------------------------------------------------------- generation
@dataclass
class SamplingDefaults:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def params_for(self, record: dict):
        from vllm import SamplingParams

        kw: dict[str, Any] = dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  ignore_eos=self.ignore_eos)
        kw.update(record.get("sampling") or {})
        if kw.get("temperature", 0) > 0 and "seed" not in kw:
            # Stable per-request seed: a redone prompt draws the same tokens.
            digest = hashlib.sha256(f"{self.seed}:{id_key(record['id'])}".encode()).digest()
            kw["seed"] = int.from_bytes(digest[:4], "little")
        return SamplingParams(**kw)


def check_sampling(records: Iterable[dict], sampling: SamplingDefaults, where: str) -> None:
    """Build every record's SamplingParams now, so a bad field stops the run before an engine starts."""
    for rec in records:
        try:
            sampling.params_for(rec)
        except Exception as exc:  # noqa: BLE001 - vLLM's own message says what is wrong with the value
            what = "body" if rec["family"] == OPENAI else "sampling"
            raise BatchInputError(f"{where}:{rec['line']}: bad sampling field in {what} "
                                  f"({type(exc).__name__}: {exc})") from None


def load_tokenizer(model: str) -> Any:
    """The target's tokenizer, as the engine loads it (tests replace this)."""
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(model)


def prepare(todo: list[dict], args: Any) -> list[dict]:
    """Chats rendered to token ids with the target's chat template; OpenAI records told the model name."""
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    if any(needs_template(r, args.apply_chat_template) for r in todo):
        try:
            tokenizer = load_tokenizer(args.model)
        except Exception as exc:  # noqa: BLE001 - reported in one line, before any engine starts
            raise BatchInputError(f"cannot load the tokenizer of {args.model} to render chat templates: "
                                  f"{type(exc).__name__}: {exc}") from None
        todo = render_chats(todo, tokenizer, plain_as_chat=args.apply_chat_template, chat_template=chat_template,
                            where=args.input, model=args.model)
    return [{**r, "model": args.model} if r["family"] == OPENAI else r for r in todo]


def check_results_match(done: dict[str, dict], records: list[dict], output: str) -> None:
    """OpenAI requests resume only from OpenAI results, simple lines only from simple results."""
    if not done or not records:
        return
    openai_in = records[0]["family"] == OPENAI
    for rec in done.values():
        if is_openai_result(rec) != openai_in:
            kinds = ("OpenAI batch results", "simple results")
            have, want = (kinds[1], kinds[0]) if openai_in else (kinds[0], kinds[1])
            raise BatchInputError(f"{output} holds {have}, but the prompts file needs {want}; "
                                  "write to a new --output")


def _prompt_of(record: dict) -> Any:
    if "prompt" in record:
        return record["prompt"]
    return {"prompt_token_ids": list(record["prompt_token_ids"])}


def _result(record: dict, out: Any) -> dict:
    c = out.outputs[0]
    res = {"id": record["id"], "text": c.text, "token_ids": list(c.token_ids),
           "finish_reason": c.finish_reason, "prompt_tokens": len(out.prompt_token_ids or []),
           "completion_tokens": len(c.token_ids)}
    if record.get("family") == OPENAI:
        return openai_result(record, res, record.get("model", ""))
    return res


def generate_stream(llm: Any, records: Iterable[dict], sampling: SamplingDefaults, *,
                    max_in_flight: int = 256) -> Iterator[dict]:
    """Yield one result per record as soon as its request finishes.

    Drives ``llm.llm_engine`` exactly as ``LLM.generate`` does (add requests,
    ``step()`` until none is unfinished), keeping at most ``max_in_flight``
    requests queued so memory stays bounded on large files.
    """
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the LLM already has unfinished requests; use a fresh LLM for a batch job")
    pending = iter(records)
    in_flight: dict[str, dict] = {}
    counter = 0

    def feed() -> None:
        nonlocal counter
        while len(in_flight) < max_in_flight:
            rec = next(pending, None)
            if rec is None:
                return
            rid = f"batch-{counter}"
            counter += 1
            engine.add_request(rid, _prompt_of(rec), sampling.params_for(rec))
            in_flight[rid] = rec

    feed()
    while in_flight:
        for out in engine.step():
            if not out.finished:
                continue
            rid = out.request_id
            if rid not in in_flight:  # engines that append a suffix to the caller's id
                rid = rid.rsplit("-", 1)[0]
            yield _result(in_flight.pop(rid), out)
        feed()
        if in_flight and not engine.has_unfinished_requests():
            raise RuntimeError(f"the engine finished with {len(in_flight)} requests unanswered "
                               f"(e.g. {next(iter(in_flight.values()))['id']!r})")


def _progress(total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="prompt", dynamic_ncols=True, file=sys.stderr)


# ------------------------------------------------------------------------- data parallel on Ray
class _Replica:
    """One data-parallel replica: a Ray actor owning a whole LLM (its own TP group)."""

    def __init__(self, rank: int, llm_kwargs: dict, env: dict[str, str]):
        os.environ.update(env)
        from vllm import LLM

        self.rank = rank
        llm_kwargs, note = resolve_dtype(llm_kwargs)  # on the replica's node: its CPU (or GPU) decides
        if note:
            print(f"batch_generate: replica {rank}: {note}", file=sys.stderr, flush=True)
        self.llm = LLM(**llm_kwargs)

    def run(self, records: list[dict], sampling: SamplingDefaults, max_in_flight: int):
        for res in generate_stream(self.llm, records, sampling, max_in_flight=max_in_flight):
            res["replica"] = self.rank
            yield res


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(FORWARD_ENV_PREFIXES) and k not in PER_NODE_ENV}


def run_data_parallel(todo: list[dict], writer: ResultWriter, *, replicas: int, llm_kwargs: dict,
                      sampling: SamplingDefaults, resources: dict[str, float], num_cpus: float,
                      max_in_flight: int, ray_address: str | None, pbar: Any) -> list[str]:
    """Spread ``todo`` round-robin over ``replicas`` Ray actors; write results as they arrive.

    Returns the error message of every replica that failed (results of the
    others, and what the failed one finished, are kept).
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=True)
    res = dict(resources)
    num_gpus = res.pop("GPU", 0)
    actor_cls = ray.remote(_Replica).options(num_cpus=num_cpus, num_gpus=num_gpus, resources=res or None)
    shards = [todo[i::replicas] for i in range(replicas)]
    actors = [actor_cls.remote(r, llm_kwargs, forwarded_env()) for r in range(replicas) if shards[r]]
    q: queue.Queue = queue.Queue()

    def pump(rank: int, actor: Any, shard: list[dict]) -> None:
        try:
            for ref in actor.run.options(num_returns="streaming").remote(shard, sampling, max_in_flight):
                q.put(("result", ray.get(ref)))
        except Exception as exc:  # noqa: BLE001 - reported to the user below
            q.put(("error", f"replica {rank}: {type(exc).__name__}: {exc}"))
        finally:
            q.put(("done", rank))

    threads = [threading.Thread(target=pump, args=(r, a, shards[r]), daemon=True)
               for r, a in enumerate(actors)]
    for t in threads:
        t.start()
    errors, running = [], len(threads)
    try:
        while running:
            kind, payload = q.get()
            if kind == "result":
                writer.write(payload)  # BatchOutputError: stop every replica, report it
                pbar.update(1)
            elif kind == "error":
                errors.append(payload)
            else:
                running -= 1
    finally:
        for a in actors:
            ray.kill(a)
    return errors


# ------------------------------------------------------------------------- command line
def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="batch_generate.py",
        description="Generate completions for a JSONL file of prompts with vLLM and a DSpark drafter. "
                    "Results are appended to OUTPUT as each prompt finishes; rerun the same command to "
                    "resume after a crash (finished ids are skipped).")
    p.add_argument("--model", required=True, help="target model directory or name")
    p.add_argument("--draft", default=None, help="DSpark drafter checkpoint directory (omit: no speculation)")
    p.add_argument("--num-speculative-tokens", type=int, default=7, help="draft tokens per step (default 7)")
    p.add_argument("--input", required=True,
                   help="prompts JSONL: per line, an id and one of prompt, messages (a chat) or prompt_token_ids; "
                        "or OpenAI batch requests (custom_id, method, url, body) as `vllm run-batch` reads")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="send each plain \"prompt\" as one user turn through the target's chat template "
                        "(\"messages\" and OpenAI chat requests always go through it)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file, or the template text) instead of the tokenizer's")
    p.add_argument("--output", required=True, help="results JSONL (appended to; resumable)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="TP size of each replica")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="replicas; > 1 runs each replica as a Ray actor on the Ray cluster")
    p.add_argument("--ray-address", default=None, help="Ray cluster to attach to (default: RAY_ADDRESS / auto)")
    p.add_argument("--replica-resources", default=None,
                   help='Ray resources per replica as JSON (default: {"GPU": TP})')
    p.add_argument("--replica-cpus", type=float, default=1, help="Ray CPUs per replica (default 1)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="base seed; each request's seed derives from it and its id")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--kv-cache-gib", type=float, default=None,
                     help="KV cache per worker, in GiB (overrides VLLM_CPU_KVCACHE_SPACE). Default on CPU: "
                          "VLLM_CPU_KVCACHE_SPACE if set, else min(4 GiB, a quarter of the available memory); "
                          "on GPUs: vLLM's --gpu-memory-utilization rule")
    mem.add_argument("--gpu-memory-utilization", type=float, default=None,
                     help="vLLM's share of device memory per worker (on CPU: of the NUMA node's memory; "
                          "overrides VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--dtype", default="native",
                   help="the target's dtype. native (default): vLLM's auto, except float32 on a CPU without native "
                        "bf16 (no avx512_bf16 / amx_bf16), where bf16 is emulated and any step of several tokens "
                        "is slower; or any vLLM dtype")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests queued in the engine at once (bounds memory; default 256)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts of the file")
    return p


def llm_kwargs_from(args) -> dict:
    kw: dict[str, Any] = dict(model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
                              enforce_eager=args.enforce_eager, seed=args.seed)
    if args.draft:
        kw["speculative_config"] = {"method": "dspark", "model": args.draft,
                                    "num_speculative_tokens": args.num_speculative_tokens}
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_gib is not None:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kw


def resolve_dtype(kw: dict, native_bf16: bool | None = None) -> tuple[dict, str | None]:
    """``dtype="native"`` made concrete where the engine runs, and a note saying what it became.

    vLLM's ``auto`` takes the checkpoint's dtype (bf16 for most). On a CPU without native bf16 those
    matmuls are emulated: a step of k tokens costs about k one-token steps (the default pair on the AVX2
    EPYC: 38 / 66 / 128 ms for 1 / 2 / 4 tokens, float32 42 / 44 / 51; ``serving/cpu_flags.py``), so
    drafts cannot pay and prefills and full batches crawl; only a lone one-token step is a little
    cheaper. A batch job wants the fast dtype, so there ``native`` is float32; everywhere else (GPUs,
    CPUs with native bf16) it is ``auto``. A deliberate difference from ``vllm serve``, which keeps
    vLLM's ``auto`` and warns."""
    if kw.get("dtype") != "native":
        return kw, None
    from vllm.platforms import current_platform

    from vllm_dspark.serving import cpu_flags

    if not current_platform.is_cpu() or (cpu_flags.has_native_bf16() if native_bf16 is None else native_bf16):
        return {**kw, "dtype": "auto"}, None
    return {**kw, "dtype": "float32"}, ("--dtype native: float32 (this CPU has no native bf16, so bf16 would be "
                                        "emulated and slower; --dtype auto keeps the checkpoint's dtype)")


MEMORY_ENV = "VLLM_CPU_KVCACHE_SPACE"


def memory_flags_win(args, environ: dict | None = None) -> str | None:
    """--kv-cache-gib / --gpu-memory-utilization win over VLLM_CPU_KVCACHE_SPACE (which vLLM would let win).

    Removes the variable from ``environ`` (default: this process's, which replicas inherit) and
    returns a note saying so, or None.
    """
    env = os.environ if environ is None else environ
    flag = ("--kv-cache-gib" if args.kv_cache_gib is not None
            else "--gpu-memory-utilization" if args.gpu_memory_utilization is not None else None)
    if flag is None or env.get(MEMORY_ENV, "") == "":
        return None
    value = env.pop(MEMORY_ENV)
    return f"{flag} is given, so {MEMORY_ENV}={value} from the environment is ignored"


def startup_error(exc: BaseException) -> str | None:
    """One line for an engine that would not start: our own start-up errors, and vLLM's memory refusal.

    None for anything else (the caller re-raises: a traceback is the useful report there).
    """
    from vllm_dspark.plugin import _dspark_error
    from vllm_dspark.serving.memory import is_memory_error

    ours = _dspark_error(exc)
    if ours is not None:
        # This script's flag for vLLM's --kv-cache-memory-bytes is --kv-cache-gib.
        return re.sub(r"--kv-cache-memory-bytes (\d+)", lambda m: f"--kv-cache-gib {int(m[1]) / (1 << 30):g}",
                      str(ours))
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if is_memory_error(e):
            return (f"vLLM refused to start for memory: {str(e).splitlines()[0]} Change --kv-cache-gib "
                    f"(or {MEMORY_ENV}) or --gpu-memory-utilization")
    if "Engine core initialization failed" in str(exc):
        return ("the vLLM engine failed to start; its error is logged above. If it is about memory, pass a "
                f"smaller --kv-cache-gib (or set {MEMORY_ENV}=<GiB>)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = lambda msg: print(f"batch_generate: {msg}", file=sys.stderr)  # noqa: E731
    try:
        records = read_prompts(args.input)
    except BatchInputError as exc:
        err(str(exc))
        return 2
    try:
        done, note = load_done(args.output)
    except BatchInputError as exc:
        err(str(exc))
        return 2
    except OSError as exc:  # the results file cannot be read, or its torn last line not cut off
        err(str(output_error(args.output, exc)))
        return 2
    if note:
        err(note)
    if args.limit is not None:
        records = records[:args.limit]
    todo = [r for r in records if id_key(r["id"]) not in done]
    sampling = SamplingDefaults(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, ignore_eos=args.ignore_eos)
    try:  # every line checked before an engine starts
        check_results_match(done, records, args.output)
        if todo:
            check_sampling(todo, sampling, args.input)
            todo = prepare(todo, args)
    except BatchInputError as exc:
        err(str(exc))
        return 2
    finished = len(records) - len(todo)
    stray = len(set(done) - {id_key(r["id"]) for r in records})
    err(f"{len(records)} prompts, {finished} already in {args.output}, {len(todo)} to generate"
        + (f" ({stray} results in the output have no prompt in the input)" if stray else ""))
    if not todo:
        return 0
    kw = llm_kwargs_from(args)
    note = memory_flags_win(args)
    if note:
        err(note)
    try:  # before the engine starts: an unwritable output should not cost a model load
        writer = ResultWriter(args.output)
    except BatchOutputError as exc:
        err(str(exc))
        return 2
    llm = None
    try:
        with writer:  # closing it reports a late failure (fsync) the same way
            if args.data_parallel <= 1:
                from vllm import LLM

                local_kw, dtype_note = resolve_dtype(kw)
                if dtype_note:
                    err(dtype_note)
                try:
                    llm = LLM(**local_kw)  # before the progress bar: start-up is not prompt time
                except Exception as exc:
                    line = startup_error(exc)
                    if line is None:
                        raise
                    err(line)
                    return 2
            pbar = _progress(len(records), finished, "prompts")
            try:
                if llm is None:
                    resources = (json.loads(args.replica_resources) if args.replica_resources
                                 else {"GPU": args.tensor_parallel_size})
                    errors = run_data_parallel(todo, writer, replicas=args.data_parallel, llm_kwargs=kw,
                                               sampling=sampling, resources=resources,
                                               num_cpus=args.replica_cpus, max_in_flight=args.max_in_flight,
                                               ray_address=args.ray_address, pbar=pbar)
                else:
                    for res in generate_stream(llm, todo, sampling, max_in_flight=args.max_in_flight):
                        writer.write(res)
                        pbar.update(1)
                    errors = []
            finally:
                pbar.close()
    except BatchOutputError as exc:
        err(str(exc))
        return 1
    if errors:
        for e in errors:
            err(e)
        err(f"{len(errors)} replica(s) failed; every finished result is in {args.output}. "
            "Rerun the same command to generate the rest.")
        return 1
    return 0
