"""Two executors driven as a scheduler drives a K/V move between them: each side's plan stream,
and every kv_imports_done entry its results brought."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import PlanStream

IMPORT_TIMEOUT_S = 30.0


@dataclass
class MoveSide:
    """served: what the test knows of this executor (its address, channel, ...)."""

    served: Any
    stream: PlanStream
    imports_done: list[pb.KvImportResult] = field(default_factory=list)

    def step(self, **fields: object) -> pb.StepResult:
        result = self.stream.plan(**fields)
        self.imports_done.extend(result.kv_imports_done)
        return result

    def run(self, **fields: object) -> pb.StepResult:
        """A step none of whose entries may be refused."""
        result = self.step(**fields)
        assert not result.rejected, result.rejected
        return result

    def wait_imports(self, transfer_ids: set[str]) -> dict[str, pb.KvImportResult]:
        """Empty plans until every one of these imports has ended."""
        deadline = time.monotonic() + IMPORT_TIMEOUT_S
        while True:
            ended = {done.transfer_id: done for done in self.imports_done if done.transfer_id in transfer_ids}
            if set(ended) == transfer_ids:
                return ended
            assert time.monotonic() < deadline, f"imports {transfer_ids - set(ended)} never ended"
            time.sleep(0.02)
            self.run()
