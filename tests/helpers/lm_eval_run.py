"""Runs one lm-evaluation-harness task and prints its results and per-sample responses as JSON,
in a process of its own (lm-eval imports datasets, pandas and more; the hub is unreachable, so
it runs offline).

    python -m tests.helpers.lm_eval_run TASK_DIR TASK MODEL MODEL_ARGS
"""

from __future__ import annotations

import json
import sys


def main(task_dir: str, task: str, model: str, model_args: str) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=task_dir),
        device="cpu",
        batch_size=1,
        log_samples=True,
    )
    assert results is not None
    samples = [sample["resps"] for sample in results["samples"][task]]
    json.dump({"results": results["results"][task], "responses": samples}, sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:])
