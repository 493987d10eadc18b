"""Tokenizers that megatron-core's GPT datasets can use.

megatron-core's ``GPTDatasetConfig`` takes a tokenizer object and reads only a few things
from it:

* ``vocab_size`` -- to pick the on-disk token dtype (uint16 below 65536 ids, else int32);
* ``eod`` -- the end-of-document id, used by the loss/position masks and by mock data;
* ``unique_identifiers`` -- a JSON-able dict hashed into the name of the cached sample indices;
* ``pad`` (optional) -- absent here, so megatron pads with its private id -1.

Our preprocessing also needs ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``.
Both tokenizers below subclass megatron-core's current abstract tokenizer
``megatron.core.tokenizers.MegatronTokenizerBase`` (the type ``GPTDatasetConfig.tokenizer``
is annotated with; the older ``megatron.core.datasets.megatron_tokenizer`` class is
deprecated in 0.16 and warns on every construction).

Two kinds exist:

* ``ByteTokenizer`` -- needs no file: ids 0..255 are the UTF-8 bytes, id 256 is EOD.
* ``JsonTokenizer`` -- a Hugging Face ``tokenizers`` ``tokenizer.json`` (for example the BPE
  tokenizer trained by ``megatron_ext.data.corpus``, or a Llama's own). Its EOD is the token
  named by ``--eod-token``, else the ``eos_token`` of a ``tokenizer_config.json`` beside it (what
  Megatron-LM's ``HuggingFaceTokenizer`` uses), else the first of :data:`EOD_CANDIDATES` it has.
"""

import json
import os
from collections import OrderedDict
from collections.abc import Iterable

import tokenizers
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_ext.io import why_not_a_file

EOD_TOKEN = "<|endoftext|>"
"""Text form of the end-of-document token of this package's own tokenizers."""

EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
"""End-of-document tokens looked for, in this order (GPT-2 / this corpus, Llama 3, Llama 2 /
Mistral, Gemma), when neither ``--eod-token`` nor a ``tokenizer_config.json`` names one."""


class Tokenizer(MegatronTokenizerBase):
    """Common base: the megatron-facing identity of a tokenizer.

    Subclasses provide ``tokenize``, ``detokenize``, ``vocab``, ``vocab_size`` and ``eod``.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, config={})

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What makes cached dataset indices built with this tokenizer reusable."""
        return OrderedDict(
            [
                ("class", type(self).__name__),
                ("tokenizer_path", self.path),
                ("vocab_size", self.vocab_size),
                ("eod", self.eod),
            ]
        )

    def apply_chat_template(self, *args, **kwargs):
        """Required by ``MegatronTokenizerBase``; pretraining tokenizers have no chat format."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, id 256 is the end-of-document token."""

    eod_token = EOD_TOKEN
    """Text form of the end-of-document token (how ``detokenize`` shows it)."""

    def __init__(self) -> None:
        super().__init__(path="byte")

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` as its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode bytes back to text; EOD is rendered as ``<|endoftext|>``.

        Invalid UTF-8 (e.g. a window cut in the middle of a character) becomes U+FFFD.
        """
        eod = EOD_TOKEN.encode("utf-8")
        data = b"".join(eod if int(i) == self.eod else bytes([int(i)]) for i in ids)
        return data.decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        """The end-of-document id, one past the last byte."""
        return 256

    @property
    def vocab_size(self) -> int:
        """256 bytes plus EOD."""
        return 257

    @property
    def vocab(self) -> dict[str, int]:
        """Token text -> id; bytes are shown as ``<0xNN>``."""
        table = {f"<0x{b:02X}>": b for b in range(256)}
        table[EOD_TOKEN] = self.eod
        return table


class JsonTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` model loaded from a ``tokenizer.json`` file.

    ``eod`` is the id of ``eod_token`` (see the module docstring for how it is found).
    Special tokens written literally in the input text are encoded as ordinary text, so
    only the preprocessing step (``append_eod``) ever produces the EOD id.
    """

    def __init__(self, path: str, eod_token: str | None = None) -> None:
        super().__init__(path=os.path.abspath(path))
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(self.path)
        except Exception as exc:  # the Rust library's own error type: one line, the file named
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ValueError(f"--tokenizer-model: '{self.path}' is not a tokenizers "
                             f"tokenizer.json ({reason})") from None
        self._tokenizer.encode_special_tokens = True
        self.eod_token = _eod_token(self._tokenizer, self.path, eod_token)
        """Text form of the end-of-document token."""
        self._eod = self._tokenizer.token_to_id(self.eod_token)

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` without adding any special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode ids to text, keeping special tokens (EOD shows as ``<|endoftext|>``)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def eod(self) -> int:
        """The id of ``eod_token``."""
        return self._eod

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        """Token text -> id, added/special tokens included."""
        return self._tokenizer.get_vocab(with_added_tokens=True)


def _config_eos(path: str) -> str | None:
    """``eos_token`` of the ``tokenizer_config.json`` beside ``path``, if there is one."""
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as stream:
        eos = json.load(stream).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _eod_token(tokenizer: tokenizers.Tokenizer, path: str, named: str | None) -> str:
    """The end-of-document token: ``named``, else the config's EOS, else a known name."""
    if named is not None:
        if tokenizer.token_to_id(named) is None:
            raise ValueError(f"--eod-token {named!r}: {path} has no such token")
        return named
    eos = _config_eos(path)
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        return eos
    for name in EOD_CANDIDATES:
        if tokenizer.token_to_id(name) is not None:
            return name
    raise ValueError(f"{path} has none of the end-of-document tokens {' '.join(EOD_CANDIDATES)}"
                     " and no tokenizer_config.json eos_token: name one with --eod-token")


def build_tokenizer(tokenizer_model: str | None, eod_token: str | None = None) -> Tokenizer:
    """Return the tokenizer named by ``tokenizer_model``.

    ``None`` or ``"byte"`` gives the built-in ``ByteTokenizer`` (vocab 257); anything else is
    read as the path of a ``tokenizers`` ``tokenizer.json`` whose end-of-document token is
    ``eod_token`` (``None``: found as the module docstring says).

    Raises:
        FileNotFoundError: the path does not name a file.
        ValueError: the file is not a tokenizer.json, no end-of-document token, or ``eod_token`` with the byte tokenizer.
    """
    if tokenizer_model is None or tokenizer_model == "byte":
        if eod_token is not None:
            raise ValueError("--eod-token needs a tokenizer.json (--tokenizer-model); the byte "
                             "tokenizer's end of document is always id 256")
        return ByteTokenizer()
    if not os.path.isfile(tokenizer_model):
        raise FileNotFoundError(
            f"tokenizer model {why_not_a_file(tokenizer_model)}: {tokenizer_model} "
            "(expected a tokenizers tokenizer.json, or 'byte')"
        )
    return JsonTokenizer(tokenizer_model, eod_token)
