"""Speculative decoding for requests with a grammar (structured outputs), planned by the real
scheduler core with grammars compiled by xgrammar for GPT-2's tokenizer, against the simulated
executor (which samples within each position's mask and checks every draft against the mask
before it): proposals are cut to what the grammar allows, every sampled position carries the
grammar's mask after the drafts before it, and the outputs are those of decoding one token at a
time; the grammar's state is left as it was by a proposal."""

from __future__ import annotations

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.structured_output import GrammarKind, StructuredOutput
from scheduler_service.structured.grammars import Grammars
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.gpt2_grammars import EOS, VOCAB_SIZE, allowed

# Lines of the same shape, which prompt lookup finds in the prompt and in the output so far.
SHAPE = StructuredOutput(GrammarKind.REGEX, source=r"(item [0-9]: (red|green|blue)\n){3,12}")
PROMPT = "item 1: red\nitem 2: green\nitem 3: blue\nitem 4: red\nitem 5: green\n" * 2


def _requests(grammars: Grammars, text: TextProcessor) -> list[Request]:
    prompt = text.tokenizer.encode(PROMPT)
    requests = []
    for i in range(4):
        request = Request(f"c{i}", [*prompt, 100 + i], SamplingParams(max_tokens=60, structured_output=SHAPE))
        request.grammar = grammars.state(SHAPE, VOCAB_SIZE, [EOS], [])
        requests.append(request)
    return requests


def _run(requests: list[Request], k: int) -> tuple[dict[str, list[int]], Scheduler, list[int]]:
    """Outputs, the scheduler, and the number of drafts each constrained entry carried."""
    config = SchedulerConfig(num_kv_blocks=256, block_size=4, max_model_len=512, num_speculative_tokens=k)
    scheduler = Scheduler(config, eos_token_ids=[EOS])
    executor = SimulatedExecutor(256, 4)
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {}
    drafted: list[int] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        for entry in plan.continuing_requests:
            if entry.draft_token_ids:
                # A mask for the last token's position and one after each draft.
                assert entry.allowed_token_bitmask and len(entry.draft_bitmasks) == len(entry.draft_token_ids)
                assert all(allowed(mask) for mask in entry.draft_bitmasks)
                drafted.append(len(entry.draft_token_ids))
        for update in scheduler.update(executor.execute(plan)):
            assert update.error is None, update.error
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    return outputs, scheduler, drafted


def test_constrained_requests_speculate_within_their_grammar_and_answer_as_one_at_a_time(
    grammars: Grammars, text: TextProcessor
) -> None:
    plain, _, none = _run(_requests(grammars, text), 0)
    assert not none
    outputs, scheduler, drafted = _run(_requests(grammars, text), 4)
    assert outputs == plain
    speculation = scheduler.speculation
    assert drafted and speculation.num_accepted_tokens > 0
    assert speculation.num_draft_tokens == sum(drafted)
    for request_id, tokens in outputs.items():
        assert scheduler.requests.get(request_id) is None
        body = text.tokenizer.decode(tokens[:-1] if tokens[-1] == EOS else tokens)
        assert body.count("\n") >= 3, (request_id, body)


def test_a_proposal_is_cut_before_what_the_grammar_refuses_and_leaves_its_state(grammars: Grammars, text: TextProcessor) -> None:
    state = grammars.state(SHAPE, VOCAB_SIZE, [EOS], [])
    line = text.tokenizer.encode("item 1: red\n")
    bad = text.tokenizer.encode(" purple")
    before = state.allowed_token_bitmask()
    masks = state.draft_bitmasks([*line, *bad])
    # One mask for the next position, then one after each allowed draft; none after the first
    # token the grammar refuses.
    assert len(masks) == 1 + len(line)
    assert masks[0] == before and state.allowed_token_bitmask() == before
    for token, mask in zip(line, masks, strict=False):
        assert token in allowed(mask)
    assert bad[0] not in allowed(masks[-1])
    # The state goes on from where it was: the same line is accepted token by token.
    assert all(state.accept(token) for token in line)
    # A draft that ends the sentence stays out: three lines and EOS.
    done = grammars.state(SHAPE, VOCAB_SIZE, [EOS], [*line, *line])
    assert len(done.draft_bitmasks([*line, EOS, *line])) == 1 + len(line)
    assert not done.is_terminated


def test_the_draft_method_gives_a_constrained_request_no_drafts(grammars: Grammars, text: TextProcessor) -> None:
    config = SchedulerConfig(
        num_kv_blocks=256, block_size=4, max_model_len=512, num_speculative_tokens=4, speculative_method="draft"
    )
    scheduler = Scheduler(config, eos_token_ids=[EOS])
    executor = SimulatedExecutor(256, 4, draft_token=lambda request_id, tokens: tokens[-1])
    [request, *_] = _requests(grammars, text)
    scheduler.add_request(request)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert not any(entry.num_model_drafts for entry in plan.continuing_requests)
        scheduler.update(executor.execute(plan))
    assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
