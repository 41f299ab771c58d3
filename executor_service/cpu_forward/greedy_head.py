"""The lm_head for greedy rows through an int8 screen: the same token, about half the time.

A greedy row needs only its argmax, and the head is a decode step's largest matmul. Here the
hidden rows and the weight rows are rounded to int8, each with a scale of its own, and oneDNN's
int8 linear, with the weight levels packed once, gives their integer products (VNNI does four
times the multiply-adds of fp32 per instruction). From the rounding residuals the C pass
(kernels/greedy_screen.c) bounds how far each float32 logit can be from its screen value, keeps
every token the bound cannot rule out (a few dozen of 32,000 on the models measured), and
computes those logits as the packed head does (the panel kernel's float path: one chain of fused
multiply-adds per output), bit for bit; every other logit is -inf. The row's first largest index
is then the packed head's: the screen changes no greedy token, so a greedy request's tokens
depend on its own rows alone, screened or not. It is installed only over a head the panel kernel
computes on its float path (not AMX's tiles, not oneDNN), and only after a check that its kept
logits are that head's bits. docs/cpu-executor.md ("Measured") has the times.

A channel far above the rest of its row (SmolLM2's final hidden states carry one far above the
others on random text) would set the row's int8 scale and leave the bound loose for every other
channel, and most rows would keep over an eighth of the vocabulary. Channels seen above
OUTLIER_RATIO times their row's median magnitude (looked for on one call in
OUTLIER_CHECK_EVERY) join the screen's outlier set (up to MAX_OUTLIERS, kept for the screen's
life): they are zeroed before rounding and their part of every logit is added back from the
fp32 weight columns, with its own rounding in the bound.

Rows that read more than the argmax (sampling, penalties, logprobs, min-tokens masking) take
the plain head, as does a row whose bound keeps more than an eighth of the vocabulary; after a
call where a quarter of the rows were that wide, the next 64 calls skip the screen. Which rows
are screened (this pause, the outlier set learned so far) decides only what a step costs: a
screened row's token is the plain head's. Memory: the int8 levels (a quarter of the fp32
weight), and for an untied head its plain fp32 weight beside the packed one (a tied head's is
the embedding's).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.cpu_kernels import (
    KernelUnavailable,
    declare,
    load_kernel_library,
    pointer_or_none,
)

logger = logging.getLogger(__name__)

# Largest value of a symmetric int8 level: -128 is left out so that rounding is symmetric.
LEVELS = 127
# Hidden levels travel as uint8 level + 128, the zero point oneDNN's u8 x s8 linear takes.
ZERO_POINT = 128
# Hidden sizes below this are not screened: such a head costs nothing worth saving, and
# degenerate [rows, 1] operands are where oneDNN's int8 matmul (through torch._int_mm) was seen
# to misread strides and return wrong products.
MIN_DIM = 16
# Largest |h| |W_v| screened: logits and their bounds stay far from float32's overflow (3.4e38).
# Larger (or NaN) rows take the plain head, whose float32 logits would overflow anyway.
MAX_LOGIT_BOUND = 2.0**100
# When more than 1/WIDE_SHARE_TO_PAUSE of a call's screened rows are too wide to narrow, the next
# PAUSE_CALLS calls take the plain head: the screen then costs at most one call in 65.
WIDE_SHARE_TO_PAUSE = 4
PAUSE_CALLS = 64
# A channel above this many times its row's median magnitude joins the outlier set. Gaussian
# rows of 512 reach ~8.6x at most over 20,000 rows, so random-like states add none; SmolLM2's
# final states on random tokens add a dozen or more (kept tokens then: ~76-130 at the median).
OUTLIER_RATIO = 16.0
MAX_OUTLIERS = 16
# Calls are checked for new outlier channels one in this many, the first included: the check
# (a median over every row) cost 0.15-0.4 ms of a ~30 ms random-Llama step that never finds any.
OUTLIER_CHECK_EVERY = 16
# Rows the start-up check (GreedyScreen.matches) compares with the packed head.
CHECK_ROWS = 8
# Rows of the weight quantized at a time at start, to bound the float64 scratch.
QUANTIZE_CHUNK = 4096
FLOAT32_UNIT = 2.0**-24


def matmul_rounding(dim: int) -> float:
    """gamma_dim of the float32 error analysis, plus slack for the residual's own rounding: a
    float32 dot product of dim terms, summed in any order, is within this times |h| |W_v| of
    the exact one."""
    units = dim * FLOAT32_UNIT
    return units / (1 - units) + 2.0**-20


@dataclass(slots=True, frozen=True)
class QuantizedVocab:
    """The head's weight rows W_v = scale_v * levels_v + e_v, with |e_v| and |W_v| rounded up."""

    levels: torch.Tensor
    scale: torch.Tensor
    error: torch.Tensor
    norm: torch.Tensor


def _round_up(values: torch.Tensor) -> torch.Tensor:
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(torch.inf)), rounded)


def quantize_vocab(weight: torch.Tensor) -> QuantizedVocab:
    levels = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0])
    error = torch.empty(weight.shape[0])
    norm = torch.empty(weight.shape[0])
    for start in range(0, weight.shape[0], QUANTIZE_CHUNK):
        rows = weight[start : start + QUANTIZE_CHUNK].double()
        part = slice(start, start + rows.shape[0])
        largest = rows.abs().amax(dim=1)
        row_scale = torch.where(largest > 0, largest / LEVELS, torch.ones_like(largest)).float()
        row_levels = torch.round(rows / row_scale[:, None].double()).clamp(-LEVELS, LEVELS)
        levels[part] = row_levels.to(torch.int8)
        scale[part] = row_scale
        # float32 scale times an int8 level is exact in float64, so these norms are the true
        # residual and weight norms up to float64 rounding, then rounded up to float32.
        error[part] = _round_up((rows - row_scale[:, None].double() * row_levels).norm(dim=1) * (1 + 2.0**-40))
        norm[part] = _round_up(rows.norm(dim=1) * (1 + 2.0**-40))
    return QuantizedVocab(levels=levels, scale=scale, error=error, norm=norm)


class Int8Head:
    """The head's int8 levels, packed once for oneDNN's u8 x s8 linear (the kernels PyTorch's x86
    int8 inference uses): hidden levels q arrive as q + 128 with zero point 128, scales are 1, and
    the float32 output is the integer product q . p_v, exact below 2^24 and one rounding from
    exact above."""

    def __init__(self, levels: torch.Tensor) -> None:
        self.dim = levels.shape[1]
        self._packed = torch.ops.onednn.qlinear_prepack(levels, None)
        self._scales = torch.ones(levels.shape[0])
        self._zero_points = torch.zeros(levels.shape[0], dtype=torch.int64)

    def __call__(self, shifted_levels: torch.Tensor) -> torch.Tensor:
        """[rows, dim] uint8 (level + 128) -> [rows, vocab] float32 products."""
        return torch.ops.onednn.qlinear_pointwise(
            shifted_levels, 1.0, ZERO_POINT, self._packed, self._scales, self._zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )


def int8_head_is_exact(head: Int8Head, levels: torch.Tensor) -> bool:
    """The packed int8 linear against int64 arithmetic on this weight's levels, for one row and
    several, at the extremes: oneDNN on a CPU without VNNI may saturate 16-bit intermediate
    sums, and then the screen's bound would not hold."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-LEVELS, LEVELS + 1, (4, head.dim), generator=generator)
    rows[1], rows[2] = LEVELS, -LEVELS
    for left in (rows[:1], rows):
        try:
            products = head((left + ZERO_POINT).to(torch.uint8)).double()
        except RuntimeError:
            return False
        exact = (left @ levels.long().t()).double()
        # Conversion of the integer sum to float32: exact below 2^24, one rounding above.
        if not bool(((products - exact).abs() <= exact.abs() * FLOAT32_UNIT).all()):
            return False
    return True


class GreedyScreen:
    """The screen's data for one head, and the C passes with their argument types declared."""

    def __init__(self, library: ctypes.CDLL, weight: torch.Tensor) -> None:
        self.weight = weight.detach().contiguous()
        self.vocab, self.dim = self.weight.shape
        self.quantized = quantize_vocab(self.weight)
        self.int8_head = Int8Head(self.quantized.levels)
        self._extra = matmul_rounding(self.dim)
        self.cap = max(1, self.vocab // 8)
        self.max_row_norm = MAX_LOGIT_BOUND / float(self.quantized.norm.max())
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._quantize_rows = declare(
            library.quantize_rows, [pointer, size, size, size, ctypes.c_float, pointer, pointer, pointer, pointer], None
        )
        self._screened_logits = declare(
            library.screened_logits,
            [
                pointer, pointer, size, size, *[pointer] * 7, size, pointer, size, pointer, size, size, pointer,
                ctypes.c_int,
            ],
            None,
        )
        # The outlier set: channel indices, and the weight's columns for them [vocab, channels].
        self.outliers: list[int] = []
        self._outlier_index = torch.empty(0, dtype=torch.int64)
        self._outlier_columns = torch.empty(self.vocab, 0)
        self._calls = 0

    def is_exact(self) -> bool:
        return int8_head_is_exact(self.int8_head, self.quantized.levels)

    def matches(self, head: nn.Module) -> bool:
        """Whether the logits the screen keeps are head's bits, on rows near a few vocabulary rows
        (which it narrows to a few tokens each)."""
        generator = torch.Generator().manual_seed(0)
        picked = self.weight[torch.randint(0, self.vocab, (CHECK_ROWS,), generator=generator)]
        noise = torch.randn(picked.shape, generator=generator) * picked.abs().mean(dim=1, keepdim=True)
        rows = 4 * picked + noise
        rows = rows[torch.tensor(self.screenable_rows(rows))]
        if rows.shape[0] == 0:
            return False
        logits, wide = self.logits(rows, learn=False)
        kept = torch.isfinite(logits)
        kept[wide] = False
        with torch.inference_mode():
            plain = head(rows[None])[0]
        return bool(kept.any()) and torch.equal(logits[kept], plain[kept])

    def screenable_rows(self, hidden: torch.Tensor) -> list[bool]:
        """Which of [rows, dim] hidden rows are finite and small enough to screen."""
        return (hidden.norm(dim=1) <= self.max_row_norm).tolist()

    def logits(self, hidden: torch.Tensor, learn: bool = True) -> tuple[torch.Tensor, list[int]]:
        """[rows, dim] screenable float32 hidden rows -> ([rows, vocab] logits: the packed head's
        where kept, -inf elsewhere; the rows the screen could not narrow enough, left for the
        caller to compute). learn=False leaves the outlier set as it is."""
        hidden = hidden.contiguous()
        rows = hidden.shape[0]
        if learn:
            self._learn_outliers(hidden)
        rounded, offsets, outlier_norm = hidden, None, None
        if self.outliers:
            picked = hidden[:, self._outlier_index]
            rounded = hidden.index_fill(1, self._outlier_index, 0.0)
            offsets = (picked @ self._outlier_columns.t()).contiguous()
            outlier_norm = picked.norm(dim=1)
        shifted = torch.empty(rows, self.dim, dtype=torch.uint8)
        scale, a_term, b_term = torch.empty(rows), torch.empty(rows), torch.empty(rows)
        self._quantize_rows(
            rounded.data_ptr(), rows, self.dim, self.dim, self._extra,
            shifted.data_ptr(), scale.data_ptr(), a_term.data_ptr(), b_term.data_ptr(),
        )
        if outlier_norm is not None:
            # quantize_rows charged the full matmul's rounding on |h'| only (|h| <= |h'| + |h_O|),
            # and the offsets are float32 dot products of len(outliers) terms.
            b_term += (self._extra + matmul_rounding(len(self.outliers))) * outlier_norm
        products = self.int8_head(shifted)
        out = torch.empty(rows, self.vocab)
        counts = torch.empty(rows, dtype=torch.int64)
        vocab = self.quantized
        self._screened_logits(
            products.data_ptr(), pointer_or_none(offsets), rows, self.vocab,
            scale.data_ptr(), a_term.data_ptr(), b_term.data_ptr(),
            vocab.scale.data_ptr(), vocab.error.data_ptr(), vocab.norm.data_ptr(), hidden.data_ptr(), self.dim,
            self.weight.data_ptr(), self.dim, out.data_ptr(), self.vocab, self.cap, counts.data_ptr(),
            torch.get_num_threads(),
        )
        return out, [r for r, kept in enumerate(counts.tolist()) if kept > self.cap]

    def _learn_outliers(self, hidden: torch.Tensor) -> None:
        """Adds the channels this call shows far above their rows' median to the outlier set, on one
        call in OUTLIER_CHECK_EVERY."""
        self._calls += 1
        if len(self.outliers) >= MAX_OUTLIERS or (self._calls - 1) % OUTLIER_CHECK_EVERY:
            return
        magnitude = hidden.abs()
        median = magnitude.median(dim=1, keepdim=True).values
        ratio = (magnitude / median.clamp_min(torch.finfo(torch.float32).tiny)).amax(dim=0)
        above = (ratio > OUTLIER_RATIO).nonzero().flatten()
        known = set(self.outliers)
        if set(above.tolist()) <= known:
            return
        # The furthest out first, where there is room for only some.
        ordered = above[ratio[above].argsort(descending=True)].tolist()
        new = [c for c in ordered if c not in known]
        self.outliers = sorted(known | set(new[: MAX_OUTLIERS - len(known)]))
        self._outlier_index = torch.tensor(self.outliers)
        self._outlier_columns = self.weight[:, self._outlier_index].contiguous()
        logger.info("event=greedy_screen_outliers channels=%s", ",".join(map(str, self.outliers)))


class ScreenedHead(nn.Module):
    """Wraps the model's lm_head: rows marked argmax-only by `argmax_only_rows` go through the
    screen, the rest (and every call outside that context) through the wrapped head."""

    def __init__(self, head: nn.Module, screen: GreedyScreen) -> None:
        super().__init__()
        self.head = head
        self.screen = screen
        self._argmax_only: list[bool] | None = None
        # Calls left that skip the screen after one where it could not narrow enough rows.
        self._calls_unscreened = 0

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped head's weight (a packed head's stand-in of its shape and dtype): model code
        reads it, e.g. transformers' Mamba casts its hidden states to lm_head.weight.dtype."""
        return self.head.weight

    @contextmanager
    def argmax_only_rows(self, marks: list[bool]) -> Iterator[None]:
        """marks: one per row of the next call, True where only the row's argmax is read."""
        self._argmax_only = marks
        try:
            yield
        finally:
            self._argmax_only = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        marks = self._argmax_only
        if marks is None or hidden.dim() != 3 or hidden.shape[:2] != (1, len(marks)) or not any(marks):
            return self.head(hidden)
        if self._calls_unscreened > 0:
            self._calls_unscreened -= 1
            return self.head(hidden)
        rows = hidden[0]
        screenable = self.screen.screenable_rows(rows)
        screened = [i for i, (mark, ok) in enumerate(zip(marks, screenable, strict=True)) if mark and ok]
        if not screened:
            return self.head(hidden)
        logits, full = self._screen(rows, marks, screened)
        if full:
            logits[full] = self.head(rows[full][None])[0]
        return logits[None]

    def _screen(self, rows: torch.Tensor, marks: list[bool], screened: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The screened rows' logits in a [rows, vocab] tensor, and the rows left to the head."""
        if len(screened) == len(marks):
            logits, wide = self.screen.logits(rows)
            full = [screened[i] for i in wide]
        else:
            part, wide = self.screen.logits(rows[screened])
            logits = torch.empty(len(marks), self.screen.vocab)
            logits[screened] = part
            kept = set(screened)
            full = sorted([i for i in range(len(marks)) if i not in kept] + [screened[i] for i in wide])
        if len(wide) * WIDE_SHARE_TO_PAUSE > len(screened):
            # Hidden states the bound is loose on (SmolLM2 over random token ids, whose channel
            # 199 runs ~50x the others) pay for the screen and the head both.
            self._calls_unscreened = PAUSE_CALLS
            logger.debug(
                "event=greedy_screen_paused wide=%d screened=%d calls=%d", len(wide), len(screened), PAUSE_CALLS
            )
        return logits, full


def screenable_head(model: nn.Module) -> nn.Linear | None:
    """The model's lm_head when the screen computes what it would feed the argmax: a bias-free
    fp32 linear at least MIN_DIM wide whose logits the model does not soft-cap (a tanh cap can
    make tokens that differ before it tie after it)."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or head.bias is not None or head.weight.dtype != torch.float32:
        return None
    if head.in_features < MIN_DIM or head.out_features < 2:
        return None
    if getattr(config, "final_logit_softcapping", None) is not None:
        return None
    if head.weight.device.type != "cpu" or not bool(torch.isfinite(head.weight).all()):
        return None
    return head


def float_panel_problem(head: nn.Module) -> str | None:
    """Why the screen's kept logits could not be head's bits, or None: it must be a linear the
    panel kernel computes on its float path."""
    if not isinstance(head, PackedLinear) or head.panels is None:
        return "the head is not on the panel kernel (no AVX-512F, or --no-panel-linear)"
    if head.panels.amx:
        return "the head multiplies on AMX's tiles (--amx), whose bits the screen does not reproduce"
    return None


def install_greedy_screen(model: nn.Module, weight: torch.Tensor) -> bool:
    """Wraps the model's packed lm_head, whose fp32 weight is `weight`; False with an
    event=greedy_screen line saying why when it cannot be had here."""
    head = model.get_output_embeddings()
    problem = float_panel_problem(head)
    if problem is not None:
        logger.info("event=greedy_screen enabled=false reason=%r", problem)
        return False
    try:
        library = load_kernel_library()
    except KernelUnavailable as error:
        logger.info("event=greedy_screen enabled=false reason=%r", str(error))
        return False
    if not hasattr(torch.ops.onednn, "qlinear_pointwise") or not torch.backends.mkldnn.is_available():
        logger.info("event=greedy_screen enabled=false reason='this torch has no oneDNN int8 linear'")
        return False
    screen = GreedyScreen(library, weight)
    if not screen.is_exact():
        logger.info("event=greedy_screen enabled=false reason='the int8 linear is not exact on this CPU'")
        return False
    if not screen.matches(head):
        logger.warning("event=greedy_screen enabled=false reason='its kept logits are not the packed head's bits'")
        return False
    model.set_output_embeddings(ScreenedHead(head, screen))
    logger.info("event=greedy_screen enabled=true vocab=%d dim=%d", screen.vocab, screen.dim)
    return True
