"""A PGQ profile: every GEMM of a step with its metadata and the SQNR of both its operands in
every candidate format (PGQ stage i). Plain data; ``<run>/pgq/profile.json`` holds one.

**The GEMMs.** Each linear site ``L{i}.{qkv,proj,fc1,fc2}`` and the **logits** GEMM (the
output layer, hidden -> vocabulary) run three: fprop ``(T x K) @ (K x N)`` contracting K,
dgrad ``(T x N) @ (N x K)`` contracting N, wgrad ``(N x T) @ (T x K)`` contracting T — ``T``
the tokens of one micro-batch, ``N x K`` the weight. The **embedding** lookup is the GEMM
``onehot(T x V) @ table(V x H)`` contracting the vocabulary V, with the weight gradient
``onehot.T @ dy`` contracting T; the one-hot operand is exact in every format and is left
out, so its two GEMMs carry one operand each (the table, ``dy``). Megatron runs a lookup, not
a GEMM, and neither the embedding nor the logits GEMM is in a PrecisionPlan (the platform
quantizes the linear sites): they are profiled and reported, never quantized.

**Metadata** per GEMM: the kind of each operand (activation, weight, gradient), the global
dimensions, the contracting one (every operand is quantized along it), tensor-parallel
sharding (a column-parallel layer splits N, a row-parallel one K, the embedding V; the
operand split is named, a replicated one is ``null``), the FLOPs per step (``2·T·N·K`` over
the global batch, the cost model's) and the arithmetic intensity of the GEMM one TP rank runs
per micro-batch (:func:`megatron_ext.precision.cost.gemm_intensity`, BF16 operands).

JSON (``version`` 1; a ratio of ``null`` means exact, an infinite SQNR)::

    {"version": 1, "kind": "pgq-profile", "step": 0, "steps": 2, "losses": [5.97, 5.96],
     "model": {<ModelShape fields>, "micro_tokens": 128, "tp": 1, "pp": 1, "dp": 1,
               "sequence_parallel": false},
     "candidates": {"int8": {"x": "int8@row", "w": "int8@row", "dy": "int8@row+sr"}, ...},
     "gemms": [{"name": "L0.qkv.fprop", "site": "L0.qkv", "gemm": "fprop",
                "parallel": "column", "dims": {"T": 128, "N": 256, "K": 128},
                "out": ["T", "N"], "contracting": "K", "flops": 3.4e7, "intensity": 51.2,
                "operands": {"x": {"kind": "activation", "sharded": null,
                                   "sqnr": {"int8": {"ratio": 1523.1, "db": 31.8}, ...}},
                             "w": {...}}}, ...]}
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_ext.io import read_json
from megatron_ext.precision.cost import ModelShape, gemm_intensity
from megatron_ext.methods.pgq.sqnr import to_db
from megatron_ext.sites import COLUMN_SITES, GEMM_ROLES, SITES, site_id

VERSION = 1
KIND = {"x": "activation", "w": "weight", "dy": "gradient"}
"""Semantic type of each role (the paper's metadata)."""
LINEAR_LAYOUT = {"fprop": (("T", "N"), "K"), "dgrad": (("T", "K"), "N"),
                 "wgrad": (("N", "K"), "T")}
"""A linear GEMM's output dimensions and contracting dimension."""
EMBEDDING_LAYOUT = {"fprop": ((("T", "H"), "V"), ("w",)), "wgrad": ((("V", "H"), "T"), ("dy",))}
"""The embedding's GEMMs: (output dims, contracting dim), and the operand profiled."""
SHARDED = {"column": {"w": "N", "dy": "N"}, "row": {"w": "K", "x": "K"}, "vocab": {"w": "V"}}
"""The dimension TP splits each operand along, by layer type (absent: replicated)."""
EMBEDDING, LOGITS = "embedding", "logits"


@dataclass(frozen=True)
class OperandProfile:
    """One operand of one GEMM."""

    kind: str
    """``activation``, ``weight`` or ``gradient``."""
    sharded: str | None
    """The dimension TP splits it along (``N``, ``K``, ``V``, ``T``), None if replicated."""
    sqnr: dict[str, float] = field(default_factory=dict)
    """Candidate -> SQNR ratio (``inf``: quantized exactly)."""


@dataclass(frozen=True)
class GemmProfile:
    """One GEMM of a step: metadata and operand SQNRs."""

    name: str
    """``<site>.<gemm>``: ``L0.qkv.fprop``, ``logits.dgrad``, ``embedding.wgrad``."""
    site: str
    """Linear site id, ``embedding`` or ``logits``."""
    gemm: str
    """``fprop``, ``dgrad`` or ``wgrad``."""
    parallel: str
    """Layer type under TP: ``column``, ``row`` or ``vocab`` (the embedding)."""
    dims: dict[str, int]
    """Global dimensions: T (tokens of one micro-batch), N, K (linear) or V, H (embedding)."""
    out: tuple[str, str]
    """The output's dimensions."""
    contracting: str
    """The reduction dimension; both operands are quantized along it."""
    flops: float
    """FLOPs per optimizer step, all ranks (``2·T·N·K`` over the global batch)."""
    intensity: float
    """FLOP/byte of the GEMM one TP rank runs per micro-batch (BF16 operands)."""
    operands: dict[str, OperandProfile]
    """Role -> operand, in the GEMM's order (fprop: x, w; dgrad: dy, w; wgrad: dy, x)."""

    @property
    def direction(self) -> str:
        """``forward`` (fprop) or ``backward`` (dgrad, wgrad)."""
        return "forward" if self.gemm == "fprop" else "backward"

    @property
    def linear(self) -> bool:
        """A linear site's GEMM (the only ones a plan can quantize)."""
        return self.site not in (EMBEDDING, LOGITS)

    def min_sqnr(self, candidate: str) -> tuple[float, str]:
        """(the lower SQNR of its operands in ``candidate``, that operand's role)."""
        return min((op.sqnr[candidate], role) for role, op in self.operands.items())


@dataclass(frozen=True)
class Profile:
    """Every GEMM of a step, profiled on ``steps`` batches starting at ``step``."""

    step: int
    """Training step the profile was taken before."""
    steps: int
    """Batches profiled (``--pgq-profile-steps``)."""
    losses: tuple[float, ...]
    """Loss of each profiled batch."""
    model: dict
    """``ModelShape`` fields (tokens: per step) plus micro_tokens, tp, pp, dp,
    sequence_parallel."""
    candidates: dict[str, dict[str, str]]
    """Candidate name -> role -> format name."""
    gemms: tuple[GemmProfile, ...]
    """Embedding GEMMs, then every linear site's (layer order), then the logits GEMM's."""

    def shape(self) -> ModelShape:
        """The cost model's shape of the profiled run, charged for one step."""
        names = {f.name for f in dataclasses.fields(ModelShape)}
        return ModelShape(**{k: v for k, v in self.model.items() if k in names})

    def to_dict(self) -> dict:
        return {"version": VERSION, "kind": "pgq-profile", "step": self.step,
                "steps": self.steps, "losses": list(self.losses), "model": self.model,
                "candidates": self.candidates, "gemms": [_gemm_json(g) for g in self.gemms]}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """Inverse of :meth:`to_dict`; ``ValueError`` for anything else."""
        if (not isinstance(data, dict) or data.get("kind") != "pgq-profile"
                or data.get("version") != VERSION):
            raise ValueError(f"not a version-{VERSION} PGQ profile (need \"kind\": "
                             f"\"pgq-profile\", \"version\": {VERSION})")
        try:
            gemms = tuple(_gemm_of(g) for g in data["gemms"])
            return cls(int(data["step"]), int(data["steps"]), tuple(data["losses"]),
                       dict(data["model"]), dict(data["candidates"]), gemms)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed PGQ profile: {type(exc).__name__} {exc}") from None


def _gemm_json(g: GemmProfile) -> dict:
    out = dataclasses.asdict(g)
    out["out"] = list(g.out)
    for role, op in g.operands.items():
        out["operands"][role]["sqnr"] = {
            c: {"ratio": None if r == math.inf else r, "db": None if r == math.inf else to_db(r)}
            for c, r in op.sqnr.items()}
    return out


def _gemm_of(data: dict) -> GemmProfile:
    operands = {}
    for role, op in data["operands"].items():
        ratios = {c: math.inf if v["ratio"] is None else float(v["ratio"])
                  for c, v in op["sqnr"].items()}
        operands[role] = OperandProfile(op["kind"], op["sharded"], ratios)
    fields_ = {k: data[k] for k in ("name", "site", "gemm", "parallel", "contracting")}
    return GemmProfile(**fields_, dims=dict(data["dims"]), out=tuple(data["out"]),
                       flops=float(data["flops"]), intensity=float(data["intensity"]),
                       operands=operands)


def load_profile(path: str) -> Profile:
    """Read a profile file; a one-line ``ValueError`` naming the file if it is not one."""
    data = read_json(path)
    try:
        return Profile.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"'{path}': {exc}") from None


# ---------------------------------------------------------------------------- the GEMM list


def _linear_gemms(site: str, parallel: str, n: int, k: int, shape: ModelShape, micro: int,
                  tp: int) -> list[GemmProfile]:
    sharded = SHARDED[parallel] if tp > 1 else {}
    split = sharded.get("w")  # the weight dimension TP splits
    local = {"T": micro, "N": n // tp if split == "N" else n, "K": k // tp if split == "K" else k}
    out = []
    for gemm, (dims, contracting) in LINEAR_LAYOUT.items():
        m_, n_ = (local[d] for d in dims)
        ops = {role: OperandProfile(KIND[role], sharded.get(role)) for role in GEMM_ROLES[gemm]}
        out.append(GemmProfile(f"{site}.{gemm}", site, gemm, parallel,
                               {"T": micro, "N": n, "K": k}, dims, contracting,
                               2.0 * shape.tokens * n * k,
                               gemm_intensity(m_, n_, local[contracting]), ops))
    return out


def _embedding_gemms(shape: ModelShape, micro: int, tp: int, sequence_parallel: bool
                     ) -> list[GemmProfile]:
    v, h = shape.vocab_size, shape.hidden_size
    sharded = {"w": "V", **({"dy": "T"} if sequence_parallel else {})} if tp > 1 else {}
    local = {"T": micro, "V": v // tp if tp > 1 else v, "H": h}
    out = []
    for gemm, ((dims, contracting), roles) in EMBEDDING_LAYOUT.items():
        ops = {role: OperandProfile(KIND[role], sharded.get(role)) for role in roles}
        m_, n_ = (local[d] for d in dims)
        out.append(GemmProfile(f"{EMBEDDING}.{gemm}", EMBEDDING, gemm, "vocab",
                               {"T": micro, "V": v, "H": h}, dims, contracting,
                               2.0 * shape.tokens * v * h,
                               gemm_intensity(m_, n_, local[contracting]), ops))
    return out


def gemm_list(shape: ModelShape, micro_tokens: int, tp: int,
              sequence_parallel: bool = False) -> list[GemmProfile]:
    """Every GEMM of the model (SQNRs empty), in profile order; ``shape.tokens`` is a step's
    tokens and ``shape.vocab_size`` the padded vocabulary."""
    gemms = _embedding_gemms(shape, micro_tokens, tp, sequence_parallel)
    for layer in range(shape.num_layers):
        for site in SITES:
            parallel = "column" if site in COLUMN_SITES else "row"
            gemms += _linear_gemms(site_id(layer, site), parallel, *shape.site_nk(site), shape,
                                   micro_tokens, tp)
    return gemms + _linear_gemms(LOGITS, "column", shape.vocab_size, shape.hidden_size, shape,
                                 micro_tokens, tp)
