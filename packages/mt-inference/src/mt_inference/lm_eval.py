"""lm-evaluation-harness's own command line with mt registered as the model ``mt``::

    python -m mt_inference.lm_eval --model mt --model_args checkpoint=DIR,tp=2,pp=2 \\
        --tasks boolq,piqa --num_fewshot 2 --output_path results/

(the same arguments as ``lm_eval``; under ``torchrun --nproc_per_node N -m
mt_inference.lm_eval ...`` for N processes: TP x PP from the model arguments, DP the rest). The
harness registers only its own models when it starts, so the model is registered here first
(:class:`mt_inference.harness.MTLM`); `mt eval` runs the same through its own options.
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """Register ``mt`` in lm-eval's model registry, then run lm-eval's command line."""
    from lm_eval.__main__ import cli_evaluate  # pants: no-infer-dep (the harness extra)

    import mt_inference.harness  # noqa: F401  (registers the model "mt")

    cli_evaluate()


if __name__ == "__main__":
    main()
