"""Hugging Face <-> megatron-core checkpoint conversion (``tools/convert_checkpoint.py``).

The converter never splits tensors per TP / PP rank. megatron-core's ``sharded_state_dict()``
already names every parameter's *global* tensor (key, global shape, and the layer index on a
prepended axis), and dist_checkpointing reshards global tensors to any layout at load time. So
a conversion is a map between Hugging Face tensors and megatron *global* tensors:

* :mod:`.transforms` -- lossless rearrangements (fused QKV, gate/up, vocab padding, Conv1D).
* :mod:`.families`, :mod:`.llama`, :mod:`.gpt2` -- per architecture: config.json <->
  :class:`~megatron_ext.training.presets.ModelArch`, and which HF tensors make which megatron key.
* :mod:`.spec` -- :class:`.ModelSpec`, the JSON sidecar that says which model a checkpoint holds.
* :mod:`.hf_files` -- lazy safetensors reading (one tensor at a time) and sharded writing.
* :mod:`.megatron_files` -- a streaming dist_checkpointing save strategy, per-layer loading.
* :mod:`.to_megatron`, :mod:`.to_hf`, :mod:`.verify` -- the three subcommands, driven by
  :mod:`.cli`; :mod:`.outputs` makes their output directories all-or-nothing.
"""
