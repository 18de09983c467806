"""This rank's stage of a TP x PP model as mt-model's :class:`~mt_model.DecodeModel`, so that
mt-model's decoding (:class:`~mt_model.DecodeBatch`, :func:`~mt_model.generate`) runs at any
layout: each stage keeps the key/value cache of its own layers and heads, activations go
from stage to stage (:func:`mt_pipeline.decode_step`), the last stage's TP ranks gather the
vocabulary-sharded logits (:func:`mt_tensor_parallel.gather_vocab_logits`) and choose the
same tokens from the same per-request generators, and the pipeline group hands each step's
tokens back to the other stages. Activations are sent asynchronously, so that with several
batches in flight (:func:`mt_model.interleave`) every stage works at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mt_inference.session import ScoringSession
from mt_model import KVCache
from mt_pipeline import StageComm, decode_step
from mt_tensor_parallel import gather_vocab_logits

__all__ = ["StageDecoder"]


class StageDecoder:
    """Decoding with this rank's part of a :class:`ScoringSession`'s model."""

    def __init__(self, session: ScoringSession) -> None:
        gpt = session.model.config
        self.session, self.layers, self.max_positions = session, gpt.n_layers, gpt.seq_len
        self.groups, self.comm = session.groups, StageComm.from_groups(session.groups)
        self.picks = self.groups.is_last_stage
        self.stage, self.stages = self.comm.stage, self.comm.num_stages
        self.device = self.groups.device
        self._sends: list[dist.Work] = []
        self._hidden, self._vocab = gpt.hidden, gpt.vocab_size
        session.scorer.stage.eval()  # no dropout

    def logits(self, ids: torch.Tensor, cache: KVCache, every: bool) -> torch.Tensor | None:
        self.flush()  # the previous step's activations have reached the next stage
        stage = self.session.scorer.stage
        out = decode_step(stage, self.comm, ids, cache, self._hidden, self.session.dtype,
                          self._sends, last=not every)
        if out is None:
            return None
        return gather_vocab_logits((out if every else out[:, -1]).float(), self.groups.tp,
                                   self._vocab)

    def flush(self) -> None:
        """Wait for the activations this stage sent on."""
        for work in self._sends:
            work.wait()
        self._sends.clear()

    def share(self, payload: Any) -> Any:
        if self.comm.num_stages == 1:
            return payload  # every TP rank of the one stage chose the same
        box = [payload]
        dist.broadcast_object_list(box, src=self.comm.stage_ranks[-1], group=self.comm.group,
                                   device=self.device)
        return box[0]
