"""PGQ, profile-guided quantization (paper ``shared/papers/003_ecc70c39eae9f544.txt``): log the
SQNR of both operands of every GEMM on a few real batches, then quantize the GEMMs whose
operands quantize well and whose time is set by arithmetic.

* :mod:`.sqnr` — eq. 1, the candidate formats, an operand quantized as its GEMM does it;
* :mod:`.profile` — the profile as data: every GEMM with its metadata and SQNRs (JSON);
* :mod:`.observe` — taking the profile on every rank (observed passes, one all-reduce);
* :mod:`.recipe` — thresholds, roofline filter, budget bisection, adversarial and random
  recipes, the PrecisionPlan with per-GEMM overrides; :mod:`.report` — its explanation;
* :mod:`.flags` — the flags; :mod:`.extension` — ``--precision pgq`` in training;
  :mod:`.cli` — ``tools/pgq_recipe.py``.

The modules are imported one by one (no re-exports here). See ``docs/pgq.md``.
"""
