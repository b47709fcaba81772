"""The input lines the batch job reads, checked before any engine starts, and the OpenAI-batch result shape.

Used by :mod:`vllm_dspark.tools.deploy.batch`. Each line is read on its own and becomes one
*record*, a plain dict (it travels to data-parallel replicas as it is)::

    {"id": ..., "line": n, "family": "simple" | "openai", "kind": "prompt" | "tokens" | "chat",
     "prompt": str | "prompt_token_ids": [int] | "messages": [...], "sampling": {...}}

plus, for OpenAI lines, ``"url"`` and ``"chat_template_kwargs"``. The formats:

* ``{"id": ..., "prompt": "text"}``: sent as it is (or, with ``--apply-chat-template``, as one
  user turn through the target's chat template);
* ``{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}``: a chat, rendered with the
  target tokenizer's chat template (``add_generation_prompt=True``) as ``vllm``'s chat does;
* ``{"id": ..., "prompt_token_ids": [...]}``: token ids, sent as they are;
* the OpenAI batch request that ``vllm run-batch`` reads: ``{"custom_id": ..., "method": "POST",
  "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}``; its id is ``custom_id``.

The first three (the *simple* lines) mix freely in one file and take an optional ``sampling``
object of ``SamplingParams`` fields; an OpenAI line's sampling comes from its body. A file is
either all OpenAI requests or all simple lines: the two get results of different shapes.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

SIMPLE, OPENAI = "simple", "openai"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
OPENAI_FIELDS = ("custom_id", "method", "url", "body")

# OpenAI request body field -> SamplingParams field (a null value means "not given").
BODY_SAMPLING = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}
# Body fields that do not change the answer.
BODY_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options"}
# Body fields accepted only at their default (the one answer per request this script writes).
BODY_DEFAULT_ONLY = {"n": (None, 1), "stream": (None, False), "logprobs": (None, False, 0),
                     "echo": (None, False), "best_of": (None, 1)}


class BatchInputError(ValueError):
    """The prompts file or the existing results file cannot be used."""


def id_key(rid: Any) -> str:
    """Ids compare by their JSON text, so 1 and "1" stay different."""
    return json.dumps(rid, sort_keys=True)


# ------------------------------------------------------------------------- one input line
def parse_line(obj: Any, n: int, where: str) -> dict:
    """The record of line ``n`` (already JSON-decoded); ``where`` (``file:n``) starts every error."""
    if not isinstance(obj, dict):
        raise BatchInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if any(k in obj for k in OPENAI_FIELDS):
        return _parse_openai(obj, n, where)
    return _parse_simple(obj, n, where)


def _parse_simple(obj: dict, n: int, where: str) -> dict:
    rid = obj.get("id", f"line-{n}")
    if not isinstance(rid, (str, int, float, bool)) and rid is not None:
        raise BatchInputError(f"{where}: id must be a string or number, got {rid!r}")
    given = [k for k in PROMPT_FIELDS if k in obj]
    if not given:
        raise BatchInputError(
            f"{where}: needs \"prompt\" (text), \"messages\" (a list of {{\"role\", \"content\"}} turns) or "
            "\"prompt_token_ids\" (list of ints); or, for an OpenAI batch request, \"custom_id\", \"method\", "
            "\"url\" and \"body\"")
    if len(given) > 1:
        raise BatchInputError(f"{where}: has both {given[0]!r} and {given[1]!r}; give one of them")
    rec: dict[str, Any] = {"id": rid, "line": n, "family": SIMPLE}
    field = given[0]
    if field == "prompt":
        if not isinstance(obj["prompt"], str):
            raise BatchInputError(f"{where}: prompt must be a string (token ids go in \"prompt_token_ids\")")
        rec.update(kind="prompt", prompt=obj["prompt"])
    elif field == "messages":
        rec.update(kind="chat", messages=check_messages(obj["messages"], where))
    else:
        rec.update(kind="tokens", prompt_token_ids=check_token_ids(obj["prompt_token_ids"], where,
                                                                   "prompt_token_ids"))
    sampling = obj.get("sampling", {})
    if not isinstance(sampling, dict):
        raise BatchInputError(f"{where}: sampling must be an object of SamplingParams fields")
    rec["sampling"] = dict(sampling)
    return rec


def check_token_ids(ids: Any, where: str, name: str) -> list[int]:
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                          for t in ids)):
        raise BatchInputError(f"{where}: {name} must be a list of token ids (non-negative ints)")
    if not ids:
        raise BatchInputError(f"{where}: {name} is empty; give at least one token")
    return list(ids)


def check_messages(messages: Any, where: str) -> list[dict]:
    """A chat as OpenAI writes it, with text content; list-of-parts content is joined as vLLM does."""
    if not isinstance(messages, list) or not messages:
        raise BatchInputError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                              "objects")
    out = []
    for i, msg in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(msg, dict):
            raise BatchInputError(f"{at} must be an object with \"role\" and \"content\", got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise BatchInputError(f"{at} needs a \"role\" string (\"system\", \"user\", \"assistant\", ...)")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise BatchInputError(f"{at}.content[{j}] is {kind!r}: only text parts "
                                          "({\"type\": \"text\", \"text\": ...}) are supported")
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM's "string" content format joins them
        elif not isinstance(content, str):
            raise BatchInputError(f"{at} needs a \"content\" string (or a list of text parts)")
        out.append({**msg, "content": content})
    return out


def _parse_openai(obj: dict, n: int, where: str) -> dict:
    missing = [k for k in ("custom_id", "url", "body") if k not in obj]
    if missing:
        raise BatchInputError(f"{where}: an OpenAI batch request needs {', '.join(repr(k) for k in missing)} "
                              "(a line is {\"custom_id\": ..., \"method\": \"POST\", \"url\": ..., \"body\": {...}})")
    cid, url, body = obj["custom_id"], obj["url"], obj["body"]
    if not isinstance(cid, str) or not cid:
        raise BatchInputError(f"{where}: custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise BatchInputError(f"{where}: method must be \"POST\", got {obj['method']!r}")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BatchInputError(f"{where}: url {url!r} is not answered here; use {CHAT_URL!r} or "
                              f"{COMPLETIONS_URL!r} (for other endpoints, run the file with `vllm run-batch`)")
    if not isinstance(body, dict):
        raise BatchInputError(f"{where}: body must be an object (the request of {url})")
    rec: dict[str, Any] = {"id": cid, "line": n, "family": OPENAI, "url": url}
    prompt_field = "messages" if url == CHAT_URL else "prompt"
    if prompt_field not in body:
        raise BatchInputError(f"{where}: the body of a {url} request needs {prompt_field!r}")
    if url == CHAT_URL:
        rec.update(kind="chat", messages=check_messages(body["messages"], where + ": body"))
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BatchInputError(f"{where}: body.chat_template_kwargs must be an object")
        rec["chat_template_kwargs"] = dict(kwargs)
    else:
        rec.update(_completion_prompt(body["prompt"], where))
    rec["sampling"] = _body_sampling(body, url, where)
    return rec


def _completion_prompt(prompt: Any, where: str) -> dict:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"kind": "prompt", "prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, (list, str)) for t in prompt):
        raise BatchInputError(f"{where}: body.prompt holds {len(prompt)} prompts; give one prompt per request "
                              "(one line each, with its own custom_id)")
    return {"kind": "tokens", "prompt_token_ids": check_token_ids(prompt, where, "body.prompt")}


def _body_sampling(body: dict, url: str, where: str) -> dict:
    sampling: dict[str, Any] = {}
    allowed = {*BODY_SAMPLING, *BODY_IGNORED, *BODY_DEFAULT_ONLY, "messages" if url == CHAT_URL else "prompt"}
    if url == CHAT_URL:
        allowed.add("chat_template_kwargs")
    for key, value in body.items():
        if key not in allowed:
            raise BatchInputError(f"{where}: body.{key} is not supported by batch_generate.py; remove it "
                                  "(or run the file with `vllm run-batch`)")
        if key in BODY_DEFAULT_ONLY and value not in BODY_DEFAULT_ONLY[key]:
            raise BatchInputError(f"{where}: body.{key}={value!r} is not supported (one plain answer per "
                                  f"request); remove it or set it to {BODY_DEFAULT_ONLY[key][-1]!r}")
        if key in BODY_SAMPLING and value is not None:
            sampling[BODY_SAMPLING[key]] = value
    if body.get("max_completion_tokens") is not None:  # the newer name wins, as in vLLM
        sampling["max_tokens"] = body["max_completion_tokens"]
    return sampling


def check_family(first: dict, rec: dict, where: str) -> None:
    """One file, one family: OpenAI requests and simple lines get results of different shapes."""
    if rec["family"] != first["family"]:
        names = {SIMPLE: "a simple prompt line", OPENAI: "an OpenAI batch request"}
        raise BatchInputError(
            f"{where}: this line is {names[rec['family']]}, but line {first['line']} is "
            f"{names[first['family']]}; one file holds one kind (their results have different shapes): "
            "split the file")


# ------------------------------------------------------------------------- chat templates
def needs_template(rec: dict, plain_as_chat: bool) -> bool:
    return rec["kind"] == "chat" or (plain_as_chat and rec["family"] == SIMPLE and rec["kind"] == "prompt")


def render_chats(records: list[dict], tokenizer: Any, *, plain_as_chat: bool, chat_template: str | None,
                 where: str, model: str) -> list[dict]:
    """Records whose chat (or, with ``plain_as_chat``, plain prompt as one user turn) became token ids.

    Renders as ``vllm``'s chat does: the template with ``add_generation_prompt=True`` to text, then
    that text tokenized without special tokens (the template writes them). Others pass through.
    """
    todo = [r for r in records if needs_template(r, plain_as_chat)]
    if not todo:
        return records
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        why = "has messages" if todo[0]["kind"] == "chat" else "is a prompt and --apply-chat-template is given"
        raise BatchInputError(f"{where}:{todo[0]['line']}: {why}, but the tokenizer of {model} has no chat "
                              "template; pass one with --chat-template FILE")
    out = []
    for rec in records:
        if not needs_template(rec, plain_as_chat):
            out.append(rec)
            continue
        messages = rec["messages"] if rec["kind"] == "chat" else [{"role": "user", "content": rec["prompt"]}]
        kwargs = dict(rec.get("chat_template_kwargs") or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
            ids = tokenizer.encode(text, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (raise_exception) names the fix
            raise BatchInputError(f"{where}:{rec['line']}: the chat template cannot render these messages: "
                                  f"{type(exc).__name__}: {exc}") from None
        rendered = {k: v for k, v in rec.items() if k not in ("messages", "prompt", "chat_template_kwargs")}
        out.append({**rendered, "prompt_token_ids": list(ids)})
    return out


def read_chat_template(value: str) -> str:
    """``--chat-template``: a Jinja file, or the template itself (as vLLM's flag takes it)."""
    from pathlib import Path

    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long template is not a valid file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise BatchInputError(f"--chat-template {value}: no such file (give a Jinja file or the template text)")


# ------------------------------------------------------------------------- results
def is_openai_result(obj: dict) -> bool:
    return "custom_id" in obj and "response" in obj


def result_id(obj: dict) -> Any:
    """The request id a result record answers: ``custom_id`` for OpenAI results, else ``id``."""
    return obj["custom_id"] if is_openai_result(obj) else obj["id"]


def openai_result(rec: dict, res: dict, model: str) -> dict:
    """An OpenAI batch output line (as ``vllm run-batch`` writes) for the plain result ``res``."""
    digest = hashlib.sha256(rec["id"].encode()).hexdigest()[:24]
    usage = {"prompt_tokens": res["prompt_tokens"], "completion_tokens": res["completion_tokens"],
             "total_tokens": res["prompt_tokens"] + res["completion_tokens"]}
    choice: dict[str, Any] = {"index": 0}
    if rec["url"] == CHAT_URL:
        choice["message"] = {"role": "assistant", "content": res["text"]}
        body_id, obj = f"chatcmpl-{digest}", "chat.completion"
    else:
        choice["text"] = res["text"]
        body_id, obj = f"cmpl-{digest}", "text_completion"
    choice.update(logprobs=None, finish_reason=res["finish_reason"])
    body = {"id": body_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage}
    return {"id": f"batch_req_{digest}", "custom_id": rec["id"],
            "response": {"status_code": 200, "request_id": f"batch-{digest}", "body": body}, "error": None}
