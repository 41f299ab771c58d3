"""The executor's draft model (--draft-model, ContinuingRequest.num_model_drafts) on a ModelRunner
in this process, over a random Llama on the CPU's default float32 path: a request decoded with
the draft model's proposals answers exactly the tokens and logprobs of decoding one token a step;
a draft that is the model itself is always right (its K/V, caught up lazily, are the model's to
the bit), also after the request is rebuilt from cached blocks; entries it cannot serve are
refused saying why, and so is a draft model that cannot propose for the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor_service.model.model_support import UnsupportedModel
from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import ReadyExecutor, build_executor
from executor_service.truncated_draft import main as truncate_main
from executor_service.truncated_draft import truncate
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.draft_blocks import grow_blocks
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
BLOCKS_PER_REQUEST = 16
PROMPT = [5, 6, 7, 300, 41, 9, 800, 12]
NEW_TOKENS = 30
K = 3
GREEDY = pb.SamplerConfig(temperature=0, want_logprobs=True, num_logprobs=2)
SEEDED = pb.SamplerConfig(temperature=1.0, has_seed=True, seed=77, want_logprobs=True, num_logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("llama"))


def _ready(model_dir: Path, draft_dir: Path | None) -> ReadyExecutor:
    torch.set_num_threads(1)
    settings = ExecutorSettings(
        model_dir=model_dir, device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, draft_model_dir=draft_dir
    )
    return build_executor(settings)


@pytest.fixture(scope="module")
def truncated(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ReadyExecutor:
    return _ready(model_dir, truncate(model_dir, tmp_path_factory.mktemp("draft") / "first-layer", layers=1))


@pytest.fixture(scope="module")
def itself(model_dir: Path) -> ReadyExecutor:
    return _ready(model_dir, model_dir)


class Steps:
    def __init__(self, runner: ModelRunner) -> None:
        runner.drop_all_requests(wipe_kv=True)
        self.runner = runner
        self.step_id = 0

    def run(self, *entries: pb.NewRequest | pb.ContinuingRequest) -> pb.StepResult:
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id)
        for entry in entries:
            (plan.new_requests if isinstance(entry, pb.NewRequest) else plan.continuing_requests).append(entry)
        result = self.runner.execute(grow_blocks(self.runner, plan))
        assert not result.HasField("failure"), result.failure.message
        return result


def _new(sampling: pb.SamplerConfig, tokens: list[int] = PROMPT, computed: int = 0) -> pb.NewRequest:
    return pb.NewRequest(
        request_id="r",
        token_ids=tokens,
        block_ids=range(BLOCKS_PER_REQUEST),
        num_computed_tokens=computed,
        num_scheduled_tokens=len(tokens) - computed,
        sampling=sampling,
    )


def _decode(runner: ModelRunner, sampling: pb.SamplerConfig, drafts: int) -> tuple[list[int], list[bytes], list[int]]:
    """The request's tokens, logprob records (serialized) and tokens per step, decoded one token
    a step (drafts 0) or with the draft model proposing `drafts` a step."""
    steps = Steps(runner)
    tokens: list[int] = []
    records: list[bytes] = []
    per_step: list[int] = []
    result = steps.run(_new(sampling))
    while True:
        assert not result.rejected, result.rejected[0].message
        [output] = result.outputs
        tokens += output.token_ids
        records += [record.SerializeToString() for record in output.logprobs]
        per_step.append(len(output.token_ids))
        if len(tokens) >= NEW_TOKENS:
            return tokens[:NEW_TOKENS], records[:NEW_TOKENS], per_step[1:]
        result = steps.run(pb.ContinuingRequest(request_id="r", num_scheduled_tokens=1 + drafts, num_model_drafts=drafts))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_truncated_draft_models_proposals_leave_the_tokens_and_logprobs_of_decoding_one_at_a_time(
    truncated: ReadyExecutor, sampling: pb.SamplerConfig
) -> None:
    assert truncated.info.draft_model and truncated.info.supports_draft_tokens
    runner = truncated.runner
    plain = _decode(runner, sampling, 0)
    forwards = runner.draft.num_forwards if runner.draft is not None else 0
    speculative = _decode(runner, sampling, K)
    assert speculative[:2] == plain[:2]
    # The draft model ran: a catch-up and K - 1 decodes for each verifying step.
    assert runner.draft is not None and runner.draft.num_forwards == forwards + K * len(speculative[2])
    assert all(1 <= answered <= K + 1 for answered in speculative[2])


def test_the_model_as_its_own_draft_is_always_right_also_after_the_request_is_rebuilt(itself: ReadyExecutor) -> None:
    runner = itself.runner
    plain, _, _ = _decode(runner, GREEDY, 0)
    tokens, _, per_step = _decode(runner, GREEDY, K)
    assert tokens == plain
    # Every step accepts all K drafts, but the last, which may stop early at NEW_TOKENS.
    assert per_step[:-1] == [K + 1] * (len(per_step) - 1)
    # Rebuilt from its cached blocks (as after a scheduler restart): the draft model has none of
    # its K/V and catches up on the whole context before proposing, still always right.
    known = PROMPT + tokens[:10]
    steps = Steps(runner)
    steps.run(_new(GREEDY, known[:-1]))
    result = steps.run(_new(GREEDY, known, computed=len(known) - 1))
    assert list(result.outputs[0].token_ids) == [plain[10]]
    result = steps.run(pb.ContinuingRequest(request_id="r", num_scheduled_tokens=1 + K, num_model_drafts=K))
    assert list(result.outputs[0].token_ids) == plain[11 : 12 + K]


def test_entries_the_draft_model_cannot_serve_are_refused_saying_why(model_dir: Path, truncated: ReadyExecutor) -> None:
    steps = Steps(truncated.runner)
    steps.run(_new(GREEDY))
    both = pb.ContinuingRequest(request_id="r", num_scheduled_tokens=3, num_model_drafts=2, draft_token_ids=[1, 2])
    [refused] = steps.run(both).rejected
    assert "both draft_token_ids and num_model_drafts" in refused.message
    steps.run(_new(GREEDY))
    miscounted = pb.ContinuingRequest(request_id="r", num_scheduled_tokens=2, num_model_drafts=2)
    assert "a step with drafts computes the last sampled token and each draft (3)" in steps.run(miscounted).rejected[0].message
    without = _ready(model_dir, None)
    assert not without.info.draft_model
    steps = Steps(without.runner)
    steps.run(_new(GREEDY))
    asked = pb.ContinuingRequest(request_id="r", num_scheduled_tokens=3, num_model_drafts=2)
    assert "no draft model (--draft-model)" in steps.run(asked).rejected[0].message


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(model_dir: Path, tmp_path: Path) -> None:
    other = build_model("llama", tmp_path / "other", vocab_size=512)
    with pytest.raises(UnsupportedModel, match="vocabulary of 512 tokens is not the model's 1024"):
        _ready(model_dir, other)


def test_truncated_draft_keeps_the_first_layers_and_refuses_a_layer_count_it_cannot_cut(model_dir: Path, tmp_path: Path) -> None:
    draft = truncate(model_dir, tmp_path / "draft", layers=1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert (draft / "generation_config.json").is_file()
    assert truncate_main([str(model_dir), str(tmp_path / "none"), "--layers", "2"]) == 2
    assert not (tmp_path / "none").exists()
