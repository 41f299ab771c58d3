"""A request's grammar (structured outputs) as the planning core sees it: what was asked for, and
the live state that says which tokens may come next. The state is made outside the core (by
scheduler_service/structured, over xgrammar); the core only advances it and reads its masks."""

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """The grammar a request's output must follow. `source` is the schema, regex or EBNF text
    (empty for json_object); `choices` the strings of a choice."""

    kind: GrammarKind
    source: str = ""
    choices: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        """Every way it is malformed before any compiler reads it, each as a sentence."""
        if self.kind is GrammarKind.CHOICE:
            if not self.choices:
                return ["structured_output choice needs at least one string"]
            if any(not choice for choice in self.choices):
                return ["structured_output choice strings must not be empty"]
            return []
        if self.kind is not GrammarKind.JSON_OBJECT and not self.source.strip():
            return [f"structured_output {self.kind.value} is empty"]
        return []


class TokenConstraint(Protocol):
    """Where a constrained request stands in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advances past the token; False (and no change) when the grammar does not allow it."""

    def allowed_token_bitmask(self) -> bytes:
        """The tokens that may come next: bit (t % 32) of little-endian 32-bit word t / 32."""

    def draft_bitmasks(self, drafts: Sequence[int]) -> list[bytes]:
        """For drafts proposed to follow the tokens so far: the mask of the next position, then
        the mask after each of the longest run of them the grammar allows and does not end with
        (so len - 1 of them stand). Leaves the state as it was."""
