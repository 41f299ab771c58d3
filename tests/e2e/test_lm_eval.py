"""lm-evaluation-harness (PyPI lm-eval) scores a small multiple-choice task kept in a local file
against the gateway with its local-completions model, and gets what its hf model gets on the
same weights: the same accuracies, and each choice's loglikelihood to 1e-4. Slow (two model
loads and the harness's imports): make test-slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.executor_process import start_executor
from tests.helpers.gateway_process import start_gateway
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import REPO_ROOT

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("What is the capital of Italy?", ["Paris", "Rome", "Berlin", "Madrid"], 1),
    ("What is the capital of Germany?", ["Paris", "Rome", "Berlin", "Madrid"], 2),
    ("What is the capital of Spain?", ["Paris", "Rome", "Berlin", "Madrid"], 3),
    ("What colour is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
]
TASK = "splitserve_capitals"


def write_task(folder: Path) -> Path:
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


def evaluate(task_dir: Path, model: str, model_args: str) -> dict[str, Any]:
    # The hub is unreachable: datasets and transformers must not try it. No OPENAI_API_KEY:
    # the harness then sends an empty bearer token, which a keyless gateway takes as none.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("OPENAI_API_KEY", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.lm_eval_run", str(task_dir), TASK, model, model_args],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_local_completions_against_the_gateway_scores_as_the_hf_model(prepared_model: Path, tmp_path: Path) -> None:
    task_dir = write_task(tmp_path)
    reference = evaluate(task_dir, "hf", f"pretrained={prepared_model},dtype=float32")
    with (
        start_executor(prepared_model, num_kv_blocks=512) as (executor, _),
        start_scheduler(executor, tokenizer=prepared_model) as scheduler,
        start_gateway(scheduler, served_model_name="smollm2") as gateway,
    ):
        served = evaluate(
            task_dir,
            "local-completions",
            f"base_url=http://{gateway}/v1/completions,model=smollm2,tokenizer={prepared_model},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
        )
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"][metric] == reference["results"][metric], metric
    # The reference's accuracy is neither 0 nor 1 on acc: the check can tell answers apart.
    assert 0 < reference["results"]["acc,none"] < 1
    for ours, theirs in zip(served["responses"], reference["responses"], strict=True):
        for (ours_choice,), (theirs_choice,) in zip(ours, theirs, strict=True):
            assert ours_choice[0] == pytest.approx(theirs_choice[0], abs=1e-4)
            assert ours_choice[1] == theirs_choice[1]
