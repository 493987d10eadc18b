"""What a device runs fast: the cost model's per-device rates and quantization costs.

A :class:`DeviceProfile` says, for one device, which formats a GEMM can read **natively**
(tensor cores consume them directly) and at what rate relative to BF16, and what quantizing an
operand costs. :func:`megatron_ext.precision.cost.site_cost` charges a GEMM of ``2·T·N·K``
FLOPs reading operand formats ``a`` and ``b`` (docs/cost_model.md):

* both operands BF16 or wider (or passthrough): ``2·T·N·K / R``;
* both operands native: ``2·T·N·K / (R · min(rate_a, rate_b))`` plus, per quantized operand,
  its elements x :attr:`DeviceProfile.quantize_s_per_element`;
* otherwise **emulated**: the quantized operands are quantized and dequantized to BF16
  (elements x :attr:`DeviceProfile.emulate_s_per_element` each), then a BF16 GEMM,
  ``2·T·N·K / R`` — never faster than BF16.

Built-in profiles (:data:`PROFILES`), datasheet numbers (dense, no sparsity); quantization
from bytes moved at memory bandwidth: a native quantization reads the BF16 operand twice
(amax, then cast) and writes one byte per element (:data:`QUANTIZE_BYTES` = 5); an emulated
one reads it twice and writes BF16 back (:data:`EMULATE_BYTES` = 6):

==========  ==============  ===========  ==================================================
name        BF16 TFLOP/s    memory TB/s  native formats (rate vs BF16)
==========  ==============  ===========  ==================================================
nominal     989             3.35         every <= 8-bit format 2x, every <= 4-bit 4x, free
                                         quantization: the SNIP paper's speed model
cpu         2               0.3          none: every quantized format is emulated
h100        989             3.35         FP8 E4M3 / E5M2 per tensor, per row, 1x128 tiles,
                                         128x128 blocks: 2x (``torch._scaled_mm``)
h200        989             4.8          as h100
b200        2250            8            FP8 as h100, MXFP8 and MXFP6: 2x; MXFP4, NVFP4: 4x
==========  ==============  ===========  ==================================================

On Hopper INT8, MXFP8, MXFP6, MXFP4, NVFP4 and the per-block FP4 / INT4 formats are
emulated (the project runs INT8 as fake quantization; Hopper has no FP4 or MX tensor cores).
The b200 rows describe the hardware: this project's FP4 GEMMs run emulated on every device
today, so a b200 estimate for FP4 is what a native FP4 kernel would take.

``--device-profile`` (:func:`add_argument`) takes a built-in name, ``auto`` or a JSON file
(:meth:`DeviceProfile.to_json`; ``benchmarks/gpu_check.py --sections gemm`` writes a measured
one). ``auto`` (the default) is the run's GPU when its name says H100, H200 or B200, else
``nominal``: a CPU run is a rehearsal of a GPU run, and its plans and estimates stay those of
the paper's model unless a profile is named.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

from megatron_ext.errors import UsageError
from megatron_ext.formats import get_format
from megatron_ext.formats.rounding import Rounding
from megatron_ext.precision.site_formats import PASSTHROUGH

QUANTIZE_BYTES = 5.0
"""Bytes a native quantization moves per element: BF16 read for the amax, read again and one
byte written by the cast."""
EMULATE_BYTES = 6.0
"""Bytes an emulated quantization moves per element: BF16 read for the amax, read again and
BF16 written back (quantize + dequantize)."""
CLASS_KEY = "class:"
"""Prefix of a :attr:`DeviceProfile.native` key that names a class (``class:fp4``: every
format of at most 4 bits, ``class:fp8``: 5 to 8 bits) instead of one format."""


@dataclass(frozen=True)
class DeviceProfile:
    """One device's GEMM rates and quantization costs, as the cost model uses them."""

    name: str
    """What it is, for reports (``h100``, or the measured card's name)."""
    bf16_flops_per_s: float
    """BF16 GEMM rate ``R``, FLOP/s (datasheet dense peak, or measured)."""
    bytes_per_s: float
    """Memory bandwidth, bytes/s (what built-in quantization costs are derived from)."""
    native: tuple[tuple[str, float], ...]
    """(format name or ``class:<fp4|fp8>``, rate vs BF16) for each format the tensor cores
    read natively; any other quantized format is emulated. Rounding (``+sr``) is ignored."""
    quantize_s_per_element: float
    """Seconds to quantize one element of an operand for a native GEMM (amax, scale, cast)."""
    emulate_s_per_element: float
    """Seconds to quantize and dequantize one element of an operand for an emulated GEMM."""
    nongemm_s_per_token_layer: float = 0.0
    """Time no precision changes beyond the linear GEMMs, attention core and output layer
    (norms, elementwise, optimizer, host), per token per layer: from a measured BF16 step
    (:func:`calibrate`); 0 when not measured."""
    source: str = "datasheet"
    """Where the numbers come from: ``datasheet``, or ``measured: ...``."""

    def rate(self, name: str) -> float | None:
        """Rate vs BF16 of a GEMM operand in format ``name`` when native, else None."""
        return _rate(self, name)

    def to_json(self) -> str:
        """The JSON form :meth:`from_json` reads (``native`` as an object)."""
        data = dataclasses.asdict(self)
        data["native"] = dict(self.native)
        return json.dumps({"version": 1, **data}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "device profile") -> "DeviceProfile":
        """Parse and check :meth:`to_json`'s form; ``UsageError`` (one line) when bad."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"{where}: not JSON ({err})") from None
        if not isinstance(data, dict) or data.pop("version", None) != 1:
            raise UsageError(f"{where}: expected a version 1 device profile object")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) - fields or {f.name for f in dataclasses.fields(cls)
                                  if f.default is dataclasses.MISSING} - set(data):
            raise UsageError(f"{where}: fields must be {sorted(fields)}, got {sorted(data)}")
        if not isinstance(data["native"], dict):
            raise UsageError(f"{where}: native must be an object format -> rate")
        data["native"] = tuple(data["native"].items())
        return checked(cls(**data), where)


def checked(profile: DeviceProfile, where: str = "device profile") -> DeviceProfile:
    """``profile`` if every number is finite and in range and every native key a format or
    class; ``UsageError`` naming the first problem otherwise."""
    def number(value, what, positive=True):
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0 or (positive and value == 0)):
            raise UsageError(f"{where}: {what} must be a {'positive' if positive else '>= 0'} "
                             f"number, got {value!r}")

    if not isinstance(profile.name, str) or not isinstance(profile.source, str):
        raise UsageError(f"{where}: name and source must be strings")
    number(profile.bf16_flops_per_s, "bf16_flops_per_s")
    number(profile.bytes_per_s, "bytes_per_s")
    for what in ("quantize_s_per_element", "emulate_s_per_element",
                 "nongemm_s_per_token_layer"):
        number(getattr(profile, what), what, positive=False)
    for key, rate in profile.native:
        number(rate, f"native rate of {key!r}")
        if key.startswith(CLASS_KEY):
            if key[len(CLASS_KEY):] not in ("fp4", "fp8"):
                raise UsageError(f"{where}: native class must be class:fp4 or class:fp8, "
                                 f"got {key!r}")
            continue
        try:
            get_format(key)
        except ValueError as err:
            raise UsageError(f"{where}: native {err}") from None
    return profile


def _plain(name: str):
    """Format ``name`` without stochastic rounding (a GEMM reads the same elements)."""
    return dataclasses.replace(get_format(name), rounding=Rounding.NEAREST, name="x")


def _class_of(name: str) -> str:
    bits = get_format(name).bits
    return "fp4" if bits <= 4 else "fp8" if bits <= 8 else "bf16"


@functools.lru_cache(maxsize=4096)
def _rate(profile: DeviceProfile, name: str) -> float | None:
    if name == PASSTHROUGH or _class_of(name) == "bf16":
        return None
    plain = _plain(name)
    for key, rate in profile.native:
        if not key.startswith(CLASS_KEY) and _plain(key) == plain:
            return float(rate)
    return dict(profile.native).get(CLASS_KEY + _class_of(name))


def quantized(name: str) -> bool:
    """Whether an operand in format ``name`` is quantized (narrower than BF16)."""
    return name != PASSTHROUGH and _class_of(name) != "bf16"


def _datasheet(name: str, tflops: float, tbps: float, native: dict[str, float]
               ) -> DeviceProfile:
    bytes_per_s = tbps * 1e12
    return DeviceProfile(name, tflops * 1e12, bytes_per_s, tuple(native.items()),
                         QUANTIZE_BYTES / bytes_per_s, EMULATE_BYTES / bytes_per_s)


_HOPPER_FP8 = {f"{e}{s}": 2.0 for e in ("fp8_e4m3", "fp8_e5m2")
               for s in ("", "@row", "@tile128", "@block128")}
"""The FP8 formats ``torch._scaled_mm`` runs on Hopper (``--fp8-execution real``)."""

PROFILES = {
    "nominal": DeviceProfile("nominal", 989e12, 3.35e12,
                             ((CLASS_KEY + "fp8", 2.0), (CLASS_KEY + "fp4", 4.0)), 0.0, 0.0,
                             source="the SNIP paper's speed model (FP8 2x, FP4 4x, free "
                                    "quantization)"),
    "cpu": _datasheet("cpu", 2.0, 0.3, {}),
    "h100": _datasheet("h100", 989.0, 3.35, _HOPPER_FP8),
    "h200": _datasheet("h200", 989.0, 4.8, _HOPPER_FP8),
    "b200": _datasheet("b200", 2250.0, 8.0, {**_HOPPER_FP8, "mxfp8": 2.0, "mxfp8_e5m2": 2.0,
                                             "mxfp6_e3m2": 2.0, "mxfp6_e2m3": 2.0,
                                             "mxfp4": 4.0, "nvfp4": 4.0}),
}
"""Built-in profiles by name (module docstring)."""
CHOICES = ("auto", *PROFILES)
"""Names ``--device-profile`` takes besides a file."""


def infer(device_name: str | None) -> DeviceProfile:
    """The built-in profile of a GPU named ``device_name`` (``torch.cuda.get_device_name``);
    ``nominal`` for None (CPU) or any other device."""
    upper = (device_name or "").upper()
    for key in ("h100", "h200", "b200"):
        if key.upper() in upper:
            return PROFILES[key]
    return PROFILES["nominal"]


def _run_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def resolve(spec: str | None) -> DeviceProfile:
    """The profile ``--device-profile spec`` names: ``auto`` / None (:func:`infer` on this
    process's device), a built-in name, or a JSON file; ``UsageError`` when bad."""
    if spec in (None, "auto"):
        return infer(_run_device_name())
    if spec in PROFILES:
        return PROFILES[spec]
    try:
        with open(spec, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"--device-profile {spec}: not one of {', '.join(CHOICES)} and not a "
                         f"readable file ({err.strerror})") from None
    return DeviceProfile.from_json(text, f"--device-profile {spec}")


HELP = ("the device the cost model's times assume: auto (default: the run's GPU if it is an "
        "H100, H200 or B200, else nominal), nominal (FP8 2x, FP4 4x BF16's rate, free "
        "quantization: the SNIP paper's model), cpu (every quantized format emulated), h100 / "
        "h200 (FP8 per tensor, row, tile, block native at 2x; INT8, MX and FP4 formats "
        "emulated), b200 (FP8 and MXFP8 2x, MXFP4 / NVFP4 4x), or a JSON file (benchmarks/"
        "gpu_check.py --sections gemm writes a measured one). An emulated format costs its "
        "quantization plus a BF16 GEMM (docs/cost_model.md)")


def add_argument(group) -> None:
    """``--device-profile`` on an argparse group."""
    group.add_argument("--device-profile", default="auto", metavar="NAME|FILE", help=HELP)
