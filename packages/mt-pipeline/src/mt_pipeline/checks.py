"""Static checks of a schedule: per-stage dataflow and FIFO matching of sends with receives."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from mt_pipeline.schedules import (
    Backward,
    Exchange,
    Forward,
    Instruction,
    LoadMicroBatch,
    P2POp,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
)

__all__ = [
    "SENDS",
    "MismatchError",
    "channel",
    "check_dataflow",
    "check_matching",
    "ops_of",
    "peak_in_flight",
]

# Op types whose channel runs from the executing stage to its peer.
SENDS = (SendActivation, SendGrad)
_P2P = (SendActivation, RecvActivation, SendGrad, RecvGrad)


class MismatchError(ScheduleError):
    """A send and the receive it pairs with (FIFO per stage pair) describe different tensors."""


def ops_of(instruction: Instruction) -> tuple[P2POp, ...]:
    """The P2P ops of an instruction: an Exchange's ops, a bare op alone, else ()."""
    if isinstance(instruction, Exchange):
        return instruction.ops
    if isinstance(instruction, _P2P):
        return (instruction,)
    return ()


def _virtual(stage: int, chunk: int, p: int) -> int:
    return chunk * p + stage


def _payload(stage: int, op: P2POp, p: int) -> tuple[str, int, int]:
    """(kind, micro-batch, virtual stage that consumes the tensor) as both sides see it."""
    if isinstance(op, SendActivation):
        return ("activation", op.micro_batch, _virtual(stage, op.chunk, p) + 1)
    if isinstance(op, RecvActivation):
        return ("activation", op.micro_batch, _virtual(stage, op.chunk, p))
    if isinstance(op, SendGrad):
        return ("grad", op.micro_batch, _virtual(stage, op.chunk, p) - 1)
    return ("grad", op.micro_batch, _virtual(stage, op.chunk, p))


def channel(stage: int, op: P2POp) -> tuple[int, int]:
    """(source stage, destination stage) of ``op`` executed on ``stage``."""
    return (stage, op.peer) if isinstance(op, SENDS) else (op.peer, stage)


def check_matching(schedule: Sequence[Sequence[Instruction]]) -> None:
    """Pair the k-th send from stage A to B with the k-th receive on B from A (FIFO, as NCCL
    and gloo match P2P messages) and check both describe the same tensor; raise
    :class:`MismatchError` on a bad peer, a count mismatch or a payload mismatch."""
    p = len(schedule)
    queues: dict[tuple[int, int, bool], list[tuple[str, int, int]]] = defaultdict(list)
    for stage, instructions in enumerate(schedule):
        for instruction in instructions:
            for op in ops_of(instruction):
                if not 0 <= op.peer < p or op.peer == stage:
                    raise MismatchError(f"stage {stage}: {op} has invalid peer for {p} stages")
                is_send = isinstance(op, SENDS)
                queues[(*channel(stage, op), is_send)].append(_payload(stage, op, p))
    for src, dst in sorted({(a, b) for a, b, _ in queues}):
        sends, recvs = queues[(src, dst, True)], queues[(src, dst, False)]
        for k, (sent, received) in enumerate(zip(sends, recvs)):
            if sent != received:
                raise MismatchError(
                    f"message {k} from stage {src} to stage {dst}: sent {sent}, but the "
                    f"receive expects {received} (kind, micro-batch, virtual stage)"
                )
        if len(sends) != len(recvs):
            raise MismatchError(
                f"stage {src} sends {len(sends)} messages to stage {dst}, which receives "
                f"{len(recvs)}"
            )


def _check_stage(
    stage: int, instructions: Sequence[Instruction], p: int, v: int
) -> set[tuple[int, int]]:
    """Dataflow of one stage; returns the set of (micro-batch, chunk) it ran forward."""
    last_virtual = v * p - 1
    received: set[tuple[str, int, int]] = set()
    forwarded: set[tuple[int, int]] = set()
    backwarded: set[tuple[int, int]] = set()
    loaded: set[int] = set()
    for index, ins in enumerate(instructions):
        where = f"stage {stage} instruction {index} ({ins})"
        for op in ops_of(ins):
            key = (op.micro_batch, op.chunk)
            if isinstance(op, (RecvActivation, RecvGrad)):
                received.add((type(op).__name__, *key))
            elif isinstance(op, SendActivation) and key not in forwarded:
                raise ScheduleError(f"{where}: sends an activation before its forward")
            elif isinstance(op, SendGrad) and key not in backwarded:
                raise ScheduleError(f"{where}: sends a gradient before its backward")
        if isinstance(ins, LoadMicroBatch):
            loaded.add(ins.micro_batch)
        if not isinstance(ins, (Forward, Backward)):
            continue
        key = (ins.micro_batch, ins.chunk)
        virtual = _virtual(stage, ins.chunk, p)
        if not 0 <= ins.chunk < v:
            raise ScheduleError(f"{where}: chunk outside 0..{v - 1}")
        if isinstance(ins, Forward):
            if key in forwarded:
                raise ScheduleError(f"{where}: forward repeated")
            if virtual > 0 and ("RecvActivation", *key) not in received:
                raise ScheduleError(f"{where}: forward before its activation is received")
            if virtual in (0, last_virtual) and ins.micro_batch not in loaded:
                raise ScheduleError(f"{where}: forward before LoadMicroBatch")
            forwarded.add(key)
        else:
            if key not in forwarded or key in backwarded:
                raise ScheduleError(f"{where}: backward without one earlier forward")
            if virtual < last_virtual and ("RecvGrad", *key) not in received:
                raise ScheduleError(f"{where}: backward before its gradient is received")
            backwarded.add(key)
    if forwarded != backwarded:
        missing = sorted(forwarded - backwarded)
        raise ScheduleError(f"stage {stage}: no backward for (micro-batch, chunk) {missing}")
    return forwarded


def check_dataflow(schedule: Sequence[Sequence[Instruction]]) -> tuple[int, int]:
    """Check every stage's own order (inputs received and micro-batches loaded before use, one
    forward then one backward per (micro-batch, chunk), sends after the result exists) and that
    all stages run the same full set of micro-batches x chunks. Returns (micro-batches, chunks).
    """
    p = len(schedule)
    if p == 0:
        raise ScheduleError("a schedule needs at least one stage, got 0")
    chunks = [i.chunk for stage in schedule for i in stage if isinstance(i, (Forward, Backward))]
    v = max(chunks, default=0) + 1
    work = [_check_stage(s, instructions, p, v) for s, instructions in enumerate(schedule)]
    m = max((mb for mb, _ in work[0]), default=-1) + 1
    expected = {(mb, c) for mb in range(m) for c in range(v)}
    for stage, done in enumerate(work):
        if done != expected:
            raise ScheduleError(
                f"stage {stage} runs {len(done)} (micro-batch, chunk) pairs, expected all "
                f"{m} x {v}; missing {sorted(expected - done)[:8]}"
            )
    return m, v


def peak_in_flight(instructions: Sequence[Instruction]) -> int:
    """Most chunk forwards whose backward has not run yet, over one stage's list."""
    live = peak = 0
    for instruction in instructions:
        if isinstance(instruction, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(instruction, Backward):
            live -= 1
    return peak
