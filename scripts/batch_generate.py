#!/usr/bin/env python
"""Offline batch generation with vLLM and a DSpark drafter: JSONL prompts in, JSONL results out.

Each input line is a plain ``prompt``, a chat (``messages``, rendered with the target's chat
template), ``prompt_token_ids``, or an OpenAI batch request (``custom_id``, ``method``, ``url``,
``body``) as ``vllm run-batch`` reads; every line is checked before an engine starts. Resumable
(rerun the same command after a crash), with a progress bar, and a data-parallel mode over
several replicas on a Ray cluster. The file formats and the resume rules are in
``vllm_dspark/tools/deploy/batch.py``; the commands are in ``docs/deployment.md``.

    python scripts/batch_generate.py --model TARGET --draft DRAFT \\
        --input prompts.jsonl --output results.jsonl [--tp 8] [--data-parallel 2] [--apply-chat-template]
"""

import sys

from vllm_dspark.tools.deploy.batch import main

if __name__ == "__main__":
    sys.exit(main())
