"""The step trace (--trace-dir DIR): every plan each executor was sent and every result applied,
every request's arrival and end, and the queues and KV use after each step.

Two files: steps.jsonl, one JSON object per event (what scheduler_service.replay reads), and
trace.json, the same steps as a Chrome/Perfetto trace (ui.perfetto.dev, chrome://tracing): one
track per executor with a slice per step, and counter tracks for the queues and KV use.

Prompts are not written: each is recorded as the digests of its full blocks (the prefix-cache
hashes, so two prompts sharing a prefix share its digests) and its length, which is all that
replaying its schedule needs.

Events (field "e"), each with "t" (seconds since the trace began) and "x" (executor address):
  up      an executor (re)joined: its planner's config (with "target_itl_s" under
          --target-itl-ms)
  add     a request placed on an executor: id, prompt length, block digests, priority,
          max_tokens, ignore_eos; "computed" when it arrived with K/V (a move), its tokens
  plan    a plan sent: step, new ids, continuing {id: tokens}, steady-decode ids, dropped ids,
          prefill and decode tokens; for a hybrid model's prefix caching, when there are any,
          the recurrent-state checkpoints it keeps ([id, tokens, slot] each) and the
          checkpoint slots new requests resume from ({id: slot}); for K/V moves, when there are
          any, "moves": offers made ("exp", [transfer, blocks] each) and ended ("end"), imports
          started ("imp", [transfer, first block, blocks] each) and abandoned ("cancel"),
          transfers named by their first 8 hex digits; with a host tier, when there are any,
          "swaps": [blocks swapped out, blocks swapped in] before the step; with speculative
          decoding, when there are any, "drafts": {id: drafts proposed} (counted in cont's tokens);
          under --target-itl-ms, "limit": the step token limit it was planned under
  result  its result applied: step, forward seconds, and after it waiting, running, KV blocks
          used and total; preemptions, prefix-hit tokens, blocks allocated and blocks released
          so far (a step's own are the differences from the previous result); and requests
          finished with reason and output length; "imported" ([transfer, ok] each) when
          imports ended; "accepted" ({id: drafts accepted}) when drafts were verified
  abort   a request ended by its client
  stop    a request ended by a stop string (found in its text after a result)
  leave   a waiting request moved to another executor
  move    a running request left with its K/V (its "add" on the destination follows)
  lost    the executor was lost: its requests leave with it
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_plan import StepOutput, StepPlan, StepUpdates
from scheduler_service.core.tenants import DEFAULT_TENANT

# Bytes of each prefix hash kept as its digest: collisions among a trace's blocks are negligible.
DIGEST_BYTES = 8
_TRACKS_PID = 1


class StepTrace:
    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._clock = clock
        self._start = clock()
        self._events: IO[str] = (directory / "steps.jsonl").open("w", encoding="utf-8")
        self._chrome: IO[str] = (directory / "trace.json").open("w", encoding="utf-8")
        # The Chrome trace format allows an array left open, so an interrupted run still loads.
        self._chrome.write("[\n")
        self._tracks: dict[str, int] = {}
        self._planned_at: dict[tuple[str, int], float] = {}

    def now(self) -> float:
        return self._clock() - self._start

    def executor_up(self, address: str, config: SchedulerConfig, pipeline_depth: int, target_itl_s: float = 0.0) -> None:
        self._write("up", address, config={
            "num_kv_blocks": config.num_kv_blocks, "block_size": config.block_size,
            "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "policy": config.policy.value,
            "mode": config.mode.value, "enable_chunked_prefill": config.enable_chunked_prefill,
            "enable_prefix_caching": config.enable_prefix_caching, "bulk_decodes": config.bulk_decodes,
            "block_copies": config.block_copies, "num_state_slots": config.num_state_slots,
            "state_checkpoint_blocks": config.state_checkpoint_blocks, "pipeline_depth": pipeline_depth,
            "speculative_method": config.speculative_method, "num_speculative_tokens": config.num_speculative_tokens,
            "speculative_max_batch": config.speculative_max_batch,
            # Traces from before --target-itl-ms have none (0: off).
            **({"target_itl_s": target_itl_s} if target_itl_s else {}),
        })
        track = self._tracks.setdefault(address, len(self._tracks) + 1)
        self._chrome_event({"name": "thread_name", "ph": "M", "pid": _TRACKS_PID, "tid": track, "args": {"name": f"executor {address}"}})

    def request_added(self, address: str, request: Request, scheduler: Scheduler) -> None:
        digests = [block_hash[:DIGEST_BYTES].hex() for block_hash in scheduler.prefix_hashes(request)]
        sampling = request.sampling
        self._write(
            "add", address, id=request.request_id, prompt=request.num_prompt_tokens,
            outputs=request.num_tokens - request.num_prompt_tokens, blocks=digests,
            priority=request.priority, max_tokens=sampling.max_tokens, ignore_eos=sampling.ignore_eos,
            fork_of=request.fork_of, **({"computed": request.num_computed_tokens} if request.num_computed_tokens else {}),
            **_tenancy(request),
        )

    def plan_sent(self, address: str, plan: StepPlan, decoded: Iterable[Request], planned_at: float) -> None:
        """planned_at: the clock's reading just before the plan was made."""
        t = planned_at - self._start
        new = [n.request_id for n in plan.new_requests]
        continuing = {c.request_id: c.num_scheduled_tokens for c in plan.continuing_requests}
        decodes = [r.request_id for r in decoded]
        prefill, decode = plan.prefill_and_decode_tokens()
        self._planned_at[(address, plan.step_id)] = t
        # Written only where a plan has them (a hybrid model's, a speculating or limited one):
        # other traces stay as they were.
        hybrid: dict[str, Any] = {}
        if plan.state_checkpoints:
            hybrid["ckpt"] = [[c.request_id, c.num_tokens, c.slot] for c in plan.state_checkpoints]
        sources = {n.request_id: n.state_source_slot for n in plan.new_requests if n.state_source_slot}
        if sources:
            hybrid["src"] = sources
        if plan.kv_exports or plan.ended_exports or plan.kv_imports or plan.cancelled_imports:
            hybrid["moves"] = {
                "exp": [[e.transfer_id[:8], len(e.block_ids)] for e in plan.kv_exports],
                "end": [tid[:8] for tid in plan.ended_exports],
                "imp": [[i.transfer_id[:8], i.first_block, len(i.block_ids)] for i in plan.kv_imports],
                "cancel": [tid[:8] for tid in plan.cancelled_imports],
            }
        if plan.swap_out or plan.swap_in:
            hybrid["swaps"] = [len(plan.swap_out), len(plan.swap_in)]
        drafts = {
            c.request_id: len(c.draft_token_ids) or c.num_model_drafts
            for c in plan.continuing_requests
            if c.draft_token_ids or c.num_model_drafts
        }
        if drafts:
            hybrid["drafts"] = drafts
        if plan.step_token_limit is not None:
            hybrid["limit"] = plan.step_token_limit
        self._write(
            "plan", address, t=t, step=plan.step_id, new=new, cont=continuing, dec=decodes,
            drop=list(plan.dropped_request_ids), prefill_tokens=prefill, decode_tokens=decode, **hybrid,
        )

    def result_applied(self, address: str, output: StepOutput, updates: StepUpdates, scheduler: Scheduler) -> None:
        t = self.now()
        stats = scheduler.kv.stats()
        finished = [
            {"id": u.request.request_id, "reason": u.request.finish_reason.value if u.request.finish_reason else None,
             "outputs": u.request.num_tokens - u.request.num_prompt_tokens}
            for u in updates.updates if u.finished
        ]
        waiting, running = scheduler.num_waiting, len(scheduler.running)
        used = stats.num_blocks - stats.num_free_blocks
        self._write(
            "result", address, t=t, step=output.step_id, forward_s=output.forward_time_s,
            waiting=waiting, running=running, kv_used=used, kv_total=stats.num_blocks,
            preemptions=scheduler.num_preemptions, hit_tokens=stats.hit_tokens,
            blocks_allocated=scheduler.kv.pool.num_allocated, blocks_released=scheduler.kv.pool.num_released,
            finished=finished,
            **({"imported": [[d.transfer_id[:8], d.ok] for d in output.kv_imports_done]} if output.kv_imports_done else {}),
            **({"accepted": {request_id: accepted for request_id, _, accepted in updates.verified}} if updates.verified else {}),
        )
        track = self._tracks.get(address, 0)
        started = self._planned_at.pop((address, output.step_id), t)
        self._chrome_event({"name": f"step {output.step_id}", "ph": "X", "pid": _TRACKS_PID, "tid": track,
                            "ts": started * 1e6, "dur": max(0.0, t - started) * 1e6})
        self._chrome_event({"name": f"queues {address}", "ph": "C", "pid": _TRACKS_PID, "ts": t * 1e6,
                            "args": {"waiting": waiting, "running": running}})
        self._chrome_event({"name": f"kv blocks {address}", "ph": "C", "pid": _TRACKS_PID, "ts": t * 1e6,
                            "args": {"used": used}})

    def executor_lost(self, address: str) -> None:
        self._write("lost", address)

    def request_ended(self, address: str, request: Request, how: str) -> None:
        """how: abort, stop, leave or move."""
        self._write(how, address, id=request.request_id, outputs=request.num_tokens - request.num_prompt_tokens)

    def close(self) -> None:
        self._events.close()
        # A last event without the trailing comma closes the array: a finished trace is strict JSON.
        self._chrome.write(json.dumps({"name": "process_name", "ph": "M", "pid": _TRACKS_PID, "args": {"name": "splitserve scheduler"}}) + "\n]\n")
        self._chrome.close()

    def _write(self, event: str, address: str, t: float | None = None, **fields: Any) -> None:
        record = {"e": event, "t": round(self.now() if t is None else t, 6), "x": address, **fields}
        self._events.write(json.dumps(record, separators=(",", ":")) + "\n")

    def _chrome_event(self, event: dict[str, Any]) -> None:
        self._chrome.write(json.dumps(event, separators=(",", ":")) + ",\n")


def _tenancy(request: Request) -> dict[str, Any]:
    """Its tenant and targets, where they differ from the defaults (so a trace without tenants
    reads as it did)."""
    fields: dict[str, Any] = {}
    if request.tenant != DEFAULT_TENANT:
        fields["tenant"] = request.tenant
    if request.ttft_deadline_s:
        fields["ttft_s"] = request.ttft_deadline_s
    if request.tpot_target_s:
        fields["tpot_s"] = request.tpot_target_s
    return fields
