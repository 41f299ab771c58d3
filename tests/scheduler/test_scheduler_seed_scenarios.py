"""The seed document's three scenarios (as built into scheduler_service.replay), with the
queues asserted step by step.

Each line: tokens scheduled per request in that step, then the waiting and running queues after
the step's results came back. Prompts of request ri are distinct, so no prefix is shared.
"""

from scheduler_service.core.policy import StepMode
from scheduler_service.replay.scenarios import SCENARIOS
from tests.helpers.sched_harness import run_seed


def test_prefill_first_starts_new_arrivals_at_once_and_pauses_decodes() -> None:
    scenario = SCENARIOS["prefill-first"]
    assert scenario.config.mode is StepMode.PREFILL_FIRST and scenario.config.max_num_seqs == 3
    result = run_seed(scenario)
    decode3 = "r2:1 r3:1 r4:1 | W: | R: r2 r3 r4"
    assert result.lines[:16] == [
        "r0:4 r1:4 r2:4 | W: r3 r4 | R: r0 r1 r2",
        "r0:1 r1:1 r2:1 | W: r3 r4 | R: r0 r1 r2",
        "r0:1 r1:1 r2:1 | W: r3 r4 | R: r2",          # r0, r1 reach max_tokens=3
        "r3:4 r4:4 | W: | R: r2 r3 r4",                # seats free: prefills only, r2 waits
        decode3, decode3, decode3, decode3, decode3, decode3,
        "r2:1 r3:1 r4:1 | W: | R: r2 r3",              # r4 done (8 tokens)
        "r2:1 r3:1 | W: | R: r2 r3",
        "r2:1 r3:1 | W: | R: r2",                      # r3 done (10 tokens)
        "r2:1 | W: | R: r2",
        "r5:4 r6:4 | W: r7 | R: r2 r5 r6",             # step 15: arrivals start, r2's decode pauses
        "r2:1 r5:1 r6:1 | W: r7 | R: r2 r5 r6",
    ]
    assert result.lines[18:20] == [
        "r2:1 r5:1 r6:1 | W: r7 | R: r2",              # r5, r6 done
        "r7:4 | W: | R: r2 r7",                        # r7 takes a seat at once, alone
    ]
    for plan in result.plans:
        kinds = {r.num_scheduled_tokens > 1 for r in plan.new_requests + plan.continuing_requests}
        assert len(kinds) <= 1, "prefill-first never mixes prefills and decodes in a step"
    assert {rid: len(tokens) for rid, tokens in result.outputs.items()} == {
        "r0": 3, "r1": 3, "r2": 30, "r3": 10, "r4": 8, "r5": 5, "r6": 5, "r7": 5
    }


def test_block_shortage_preempts_the_tail_back_to_the_head_of_waiting() -> None:
    scenario = SCENARIOS["preemption"]
    assert (scenario.config.num_kv_blocks, scenario.config.block_size) == (3, 10)
    result = run_seed(scenario)
    decode3 = "r0:1 r1:1 r2:1 | W: | R: r0 r1 r2"
    assert result.lines == [
        "r0:5 r1:5 r2:5 | W: | R: r0 r1 r2",
        decode3, decode3, decode3, decode3, decode3,
        # 3 x 10 tokens fill the 30 slots; r0 needs an 11th slot: r2 (the tail) is preempted,
        # which is not enough for r1 too, so r1 yields its own blocks. Both wait, r1 first.
        "r0:1 | W: r1 r2 | R: r0",
        "r0:1 | W: r1 r2 | R:",                        # r0 done; r1 needs 2 blocks, 1 free
        # r1's first full block survived in the prefix cache: only its last token is recomputed.
        "r1:1 | W: r2 | R: r1",
        "r1:1 | W: r2 | R:",
        "r2:11 | W: | R: r2",                          # r2's block was evicted: full recompute
        "r2:1 | W: | R:",
    ]
    assert result.scheduler.num_preemptions == 2
    assert result.plans[6].dropped_request_ids == ["r2", "r1"]
    # Resumed as a new request: prompt and the tokens generated so far, the prompt marked.
    resumed = result.plans[10].new_requests[0]
    assert (resumed.request_id, len(resumed.token_ids), resumed.num_prompt_tokens) == ("r2", 11, 5)
    assert {rid: len(tokens) for rid, tokens in result.outputs.items()} == {"r0": 8, "r1": 8, "r2": 8}
    assert result.scheduler.kv.num_free_blocks == 3


def test_decode_first_runs_admitted_requests_to_completion_before_new_ones() -> None:
    scenario = SCENARIOS["decode-first"]
    assert scenario.config.mode is StepMode.DECODE_FIRST
    result = run_seed(scenario)
    assert result.lines == [
        "r0:4 r1:6 r2:5 | W: r3 r4 | R: r0 r1 r2",
        "r0:1 r1:1 r2:1 | W: r3 r4 | R: r0 r1 r2",
        "r0:1 r1:1 r2:1 | W: r3 r4 | R: r1 r2",
        "r1:1 r2:1 | W: r3 r4 | R: r1",                # a seat is free, yet r3 keeps waiting
        "r1:1 | W: r3 r4 | R:",
        "r3:4 r4:3 | W: | R: r3 r4",
        "r3:1 r4:1 | W: | R: r4",
        "r4:1 | W: | R:",
    ]
    assert {rid: len(tokens) for rid, tokens in result.outputs.items()} == {
        "r0": 3, "r1": 5, "r2": 4, "r3": 2, "r4": 3
    }
