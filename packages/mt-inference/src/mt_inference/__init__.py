"""mt-inference: a trained checkpoint put to use, at any layout.

- :class:`~mt_inference.placement.Placement`: a checkpoint at a TP x PP layout on processes
  (data parallelism takes the rest); :func:`~mt_inference.launch.launch` runs a job of one
  on a launcher's ranks, on this process or on ``--nproc`` local processes.
- :mod:`mt_inference.model`: any checkpoint mt reads (an mt pretrain checkpoint at any
  layout, or a folder `mt convert` reads, converted once), its weights and tokenizer.
- :class:`~mt_inference.session.ScoringSession`: this rank's stage of the model joined to
  the others, with :class:`~mt_inference.scorer.StageScorer` (log-likelihoods of requests).
- :mod:`mt_inference.generation`: decoding with mt-model's key/value cache, the model whole
  (:class:`~mt_inference.generation.Generator`) or by stages
  (:class:`~mt_inference.decoder.StageDecoder`); :mod:`mt_inference.text`: text as tokens
  come, cut at stop strings.
- :mod:`mt_inference.rank` and :mod:`mt_inference.harness`: evaluation with mt-eval's engine
  or lm-evaluation-harness (mt as an lm-eval model; the ``harness`` extra);
  :mod:`mt_inference.suites`: MT-NLG's suite; :mod:`mt_inference.bias`: the bias report.
- :mod:`mt_inference.serving`: OpenAI's completions API over continuous batching on every
  rank (the ``serve`` extra).
- :mod:`mt_inference.cli`: the commands `mt eval`, `mt generate`, `mt serve` and `mt bias`
  (``mt.commands`` entry points; ``python -m mt_inference COMMAND`` without `mt`).

Nothing is imported here: the command lines start without torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
