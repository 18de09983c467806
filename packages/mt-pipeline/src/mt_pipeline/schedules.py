"""Pipeline schedules as data.

A schedule is a pure function of (stages, micro-batches[, virtual stages]) returning one ordered
list of instructions per pipeline stage. An executor maps each instruction type to a handler;
the simulator (:mod:`mt_pipeline.simulator`) checks and times the lists without processes.

Point-to-point convention (what an executor must implement)
-----------------------------------------------------------
* Every send and receive is wrapped in an :class:`Exchange`. The executor posts all ops of one
  ``Exchange`` together, in tuple order (``torch.distributed.batch_isend_irecv``), and waits for
  all of them before moving to the next instruction. Schedules never emit bare send/recv ops;
  the simulator accepts them and treats them as an ``Exchange`` of one.
* Compute instructions come in groups: one Forward or Backward each for GPipe and 1F1B; in the
  steady state of interleaved 1F1B a Forward and the Backward after it form one group. The
  ``Exchange`` between two groups X and Y holds the sends of X's results (in compute order)
  followed by the receives of Y's inputs (Megatron's ``send_forward_recv_backward`` and
  ``send_forward_backward_recv_forward_backward``). The first group has only its receives
  before it; the last only its sends after it. Each op names the *local* model chunk it
  belongs to and the peer stage.
* Messages between an ordered pair of stages match in posting order (FIFO per (src, dst)), as
  with NCCL and gloo using one tag. Schedules are built so that the k-th send from A to B
  describes the same tensor (kind, micro-batch, virtual stage) as the k-th receive on B from A,
  and so that they cannot deadlock even when a send blocks until its receive is posted
  (rendezvous semantics). The simulator checks both.
* Model chunk ``c`` of stage ``s`` holds virtual stage ``c * p + s``. An activation flows from
  virtual stage ``u`` to ``u + 1``, a gradient from ``u + 1`` to ``u``. Gradient sends go to the
  stage that ran the matching forward chunk.
* :class:`LoadMicroBatch` appears on the first stage before the forward of virtual stage 0
  (inputs) and on the last stage before the forward of the last virtual stage (targets).
* Every stage ends with :class:`ReduceTiedGrads` (a collective over the embedding group, i.e.
  first and last stage; a no-op on other stages) and :class:`OptimizerStep`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "Backward",
    "Exchange",
    "Forward",
    "Instruction",
    "LoadMicroBatch",
    "OptimizerStep",
    "P2POp",
    "RecvActivation",
    "RecvGrad",
    "ReduceTiedGrads",
    "Schedule",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "ScheduleSpec",
    "chunked_schedules",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
]


class ScheduleError(ValueError):
    """Invalid schedule parameters, or a schedule that fails a simulator check."""


@dataclass(frozen=True)
class LoadMicroBatch:
    """Load micro-batch ``micro_batch`` (inputs on the first stage, targets on the last)."""

    micro_batch: int


@dataclass(frozen=True)
class Forward:
    """Run the forward pass of local model chunk ``chunk`` on micro-batch ``micro_batch``."""

    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    """Run the backward pass of local model chunk ``chunk`` on micro-batch ``micro_batch``."""

    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True)
class SendActivation:
    """Send the output of local chunk ``chunk`` for ``micro_batch`` to stage ``peer``."""

    micro_batch: int
    peer: int
    chunk: int = 0


@dataclass(frozen=True)
class RecvActivation:
    """Receive the input of local chunk ``chunk`` for ``micro_batch`` from stage ``peer``."""

    micro_batch: int
    peer: int
    chunk: int = 0


@dataclass(frozen=True)
class SendGrad:
    """Send the input gradient of local chunk ``chunk`` for ``micro_batch`` to stage ``peer``."""

    micro_batch: int
    peer: int
    chunk: int = 0


@dataclass(frozen=True)
class RecvGrad:
    """Receive the output gradient of local chunk ``chunk`` for ``micro_batch`` from ``peer``."""

    micro_batch: int
    peer: int
    chunk: int = 0


P2POp = SendActivation | RecvActivation | SendGrad | RecvGrad


@dataclass(frozen=True)
class Exchange:
    """Post ``ops`` together (in order) as one batch of isend/irecv and wait for all of them."""

    ops: tuple[P2POp, ...]

    def __post_init__(self) -> None:
        if not self.ops:
            raise ScheduleError("Exchange needs at least one op, got 0")


@dataclass(frozen=True)
class ReduceTiedGrads:
    """Sum the tied embedding's gradient over the embedding group (first and last stage)."""


@dataclass(frozen=True)
class OptimizerStep:
    """Apply the optimizer to the gradients accumulated over all micro-batches."""


Instruction = (
    LoadMicroBatch
    | Forward
    | Backward
    | SendActivation
    | RecvActivation
    | SendGrad
    | RecvGrad
    | Exchange
    | ReduceTiedGrads
    | OptimizerStep
)
Schedule = list[list[Instruction]]

# A compute step before P2P ops are attached: (is_forward, micro_batch, chunk).
_Step = tuple[bool, int, int]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a positive int, got {value!r}")


def _recvs(step: _Step, stage: int, p: int, v: int) -> list[P2POp]:
    """The receives that must complete before ``step`` can run on ``stage``."""
    forward, mb, chunk = step
    virtual = chunk * p + stage
    if forward and virtual > 0:
        # The sender's chunk is implied by the virtual-stage rule (it holds virtual - 1).
        return [RecvActivation(mb, (stage - 1) % p, chunk)]
    if not forward and virtual < v * p - 1:
        return [RecvGrad(mb, (stage + 1) % p, chunk)]
    return []


def _sends(step: _Step, stage: int, p: int, v: int) -> list[P2POp]:
    """The sends of the results of ``step`` on ``stage``."""
    forward, mb, chunk = step
    virtual = chunk * p + stage
    if forward and virtual < v * p - 1:
        return [SendActivation(mb, (stage + 1) % p, chunk)]
    if not forward and virtual > 0:
        return [SendGrad(mb, (stage - 1) % p, chunk)]
    return []


def _lower(groups: list[list[_Step]], stage: int, p: int, v: int) -> list[Instruction]:
    """Turn one stage's compute order into instructions with P2P exchanges and loads.

    Compute steps come in groups; between two groups sits one Exchange with the sends of the
    earlier group's results and the receives of the later group's inputs.
    """
    out: list[Instruction] = []
    pending: list[P2POp] = []
    for group in groups:
        ops = pending + [op for step in group for op in _recvs(step, stage, p, v)]
        if ops:
            out.append(Exchange(tuple(ops)))
        for forward, mb, chunk in group:
            first_virtual = chunk == 0 and stage == 0
            last_virtual = chunk == v - 1 and stage == p - 1
            if forward and (first_virtual or last_virtual):
                out.append(LoadMicroBatch(mb))
            out.append(Forward(mb, chunk) if forward else Backward(mb, chunk))
        pending = [op for step in group for op in _sends(step, stage, p, v)]
    if pending:
        out.append(Exchange(tuple(pending)))
    out.extend([ReduceTiedGrads(), OptimizerStep()])
    return out


def _singles(steps: list[_Step]) -> list[list[_Step]]:
    return [[step] for step in steps]


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (in micro-batch order).

    Holds all ``num_micro_batches`` activations on every stage; bubble (p - 1) / m.
    """
    _check_positive(num_stages=num_stages, num_micro_batches=num_micro_batches)
    p, m = num_stages, num_micro_batches
    steps = [(True, i, 0) for i in range(m)] + [(False, i, 0) for i in range(m)]
    return [_lower(_singles(steps), s, p, 1) for s in range(p)]


def _one_f_one_b_steps(p: int, m: int, stage: int) -> list[_Step]:
    warmup = min(p - stage - 1, m)
    steps: list[_Step] = [(True, i, 0) for i in range(warmup)]
    for k in range(m - warmup):
        steps += [(True, warmup + k, 0), (False, k, 0)]
    steps += [(False, k, 0) for k in range(m - warmup, m)]
    return steps


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush): stage s warms up with p - s - 1 forwards, then alternates one
    forward and one backward, then drains the remaining backwards.

    Same bubble as GPipe, (p - 1) / m, but stage s holds at most min(p - s, m) activations.
    """
    _check_positive(num_stages=num_stages, num_micro_batches=num_micro_batches)
    p, m = num_stages, num_micro_batches
    return [_lower(_singles(_one_f_one_b_steps(p, m, s)), s, p, 1) for s in range(p)]


def _interleaved_step(k: int, p: int, v: int, forward: bool) -> _Step:
    """The k-th forward (or backward) on a stage: micro-batches advance in groups of p, and
    each group visits all chunks (forwards ascending, backwards descending) before the next."""
    chunk = (k // p) % v
    if not forward:
        chunk = v - 1 - chunk
    micro_batch = (k // (p * v)) * p + k % p
    return (forward, micro_batch, chunk)


def _interleaved_groups(p: int, m: int, v: int, stage: int) -> list[list[_Step]]:
    total = m * v
    # The last virtual stage's first backward can start after (v - 1) * p forwards; each step
    # away from the last stage needs two more forwards because the backward wave arrives one
    # step later per stage while the stage itself alternates F and B.
    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    groups = [[_interleaved_step(k, p, v, True)] for k in range(warmup)]
    # Steady state: one forward and one backward share their exchanges (send both results,
    # receive both next inputs), so that neighbours' exchanges pair up one to one. Exchanging
    # after every single step instead deadlocks under rendezvous sends (p=2, m=4, v=2).
    for k in range(total - warmup):
        forward = _interleaved_step(warmup + k, p, v, True)
        groups.append([forward, _interleaved_step(k, p, v, False)])
    groups += [[_interleaved_step(k, p, v, False)] for k in range(total - warmup, total)]
    return groups


def interleaved_1f1b(num_stages: int, num_micro_batches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): each stage holds ``virtual_stages`` model
    chunks; chunk c of stage s is virtual stage c * p + s. Bubble (p - 1) / (v * m).

    Requires at least 2 stages, at least 2 virtual stages, and a micro-batch count that is a
    multiple of the stage count (micro-batches move through the chunks in groups of p).
    """
    _check_positive(
        num_stages=num_stages, num_micro_batches=num_micro_batches, virtual_stages=virtual_stages
    )
    p, m, v = num_stages, num_micro_batches, virtual_stages
    if p < 2:
        raise ScheduleError(f"interleaved 1F1B needs num_stages >= 2, got num_stages={p}")
    if v < 2:
        raise ScheduleError(
            f"interleaved 1F1B needs virtual_stages >= 2, got virtual_stages={v}; "
            "use the '1f1b' schedule for one chunk per stage"
        )
    if m % p != 0:
        raise ScheduleError(
            f"interleaved 1F1B needs num_micro_batches ({m}) to be a multiple of num_stages "
            f"({p}); {m} % {p} = {m % p}"
        )
    return [_lower(_interleaved_groups(p, m, v, s), s, p, v) for s in range(p)]


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule and its traits: the one place a schedule is defined.

    Everything that depends on the schedule asks its spec (the config checks, the memory
    planner, the layout matrix), so adding a schedule is one entry here.
    """

    name: str
    """What ``--schedule`` calls it."""
    build: Callable[..., Schedule]
    """``build(num_stages, num_micro_batches[, virtual_stages])``: the instruction lists."""
    chunked: bool
    """Each stage holds several model chunks (``virtual_stages >= 2``); otherwise exactly one."""
    micro_batches_per_stage: bool
    """The micro-batch count must be a multiple of the stage count."""
    peak: Callable[[int, int, int], list[int]]
    """``peak(p, m, v)``: the most chunk forwards alive per stage (closed form; the simulator
    counts the same from the instruction lists, a test checks)."""

    def chunk_problem(self, virtual_stages: int) -> str | None:
        """Why the schedule cannot hold ``virtual_stages`` chunks per stage; None: it can."""
        v = virtual_stages
        if self.chunked and v < 2:
            return f"schedule {self.name!r} needs virtual_stages >= 2, got {v}"
        if not self.chunked and v != 1:
            return (f"schedule {self.name!r} runs one chunk per stage, got virtual_stages {v}; "
                    f"use a chunked schedule ({', '.join(chunked_schedules())})")
        return None

    def problems(self, num_stages: int, num_micro_batches: int,
                 virtual_stages: int = 1) -> list[str]:
        """Why the schedule cannot run on (p, m, v), every number named; empty: it can."""
        p, m = num_stages, num_micro_batches
        out = [msg for msg in (self.chunk_problem(virtual_stages),) if msg]
        if self.micro_batches_per_stage and (p < 2 or m % p):
            out.append(f"schedule {self.name!r} needs pp {p} >= 2 and micro-batches {m} "
                       f"divisible by pp {p}")
        return out


def _gpipe_peak(p: int, m: int, v: int) -> list[int]:
    return [m * v] * p


def _one_f_one_b_peak(p: int, m: int, v: int) -> list[int]:
    return [min(m, p - i) for i in range(p)]


def _interleaved_peak(p: int, m: int, v: int) -> list[int]:
    return [min(m * v, 2 * (p - i - 1) + (v - 1) * p + 1) for i in range(p)]


# Read-only: the set of schedules is fixed, not a registry to mutate at run time.
SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({spec.name: spec for spec in (
    ScheduleSpec("gpipe", gpipe, chunked=False, micro_batches_per_stage=False,
                 peak=_gpipe_peak),
    ScheduleSpec("1f1b", one_f_one_b, chunked=False, micro_batches_per_stage=False,
                 peak=_one_f_one_b_peak),
    ScheduleSpec("interleaved", interleaved_1f1b, chunked=True, micro_batches_per_stage=True,
                 peak=_interleaved_peak),
)})
#: The schedule of a run that names none, and of every one-stage run.
DEFAULT_SCHEDULE = "1f1b"


def chunked_schedules() -> list[str]:
    """The schedules that hold several model chunks per stage."""
    return [name for name, spec in SCHEDULES.items() if spec.chunked]


def get_schedule(
    name: str, num_stages: int, num_micro_batches: int, virtual_stages: int = 1
) -> Schedule:
    """Build the schedule called ``name`` (a key of :data:`SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    spec = SCHEDULES[name]
    if spec.chunked:
        return spec.build(num_stages, num_micro_batches, virtual_stages)
    problem = spec.chunk_problem(virtual_stages)
    if problem:
        raise ScheduleError(problem)
    return spec.build(num_stages, num_micro_batches)
