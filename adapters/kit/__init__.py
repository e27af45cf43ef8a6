"""What the first-party plugins are built from, apart from the plugins themselves.

The plugins (the modules of the entry-point group ``layergraph``: ``internvl``, ``pixtral``,
``qwen2_vl``, ``sequential``, ``siglip2``, ``timm_vit``, ``towers``, ``hf_capture``) sit at the
top of ``layergraph_adapters``; everything they share or hold apart sits here: the kits a
family is built from (``tower_specs`` and ``hf_vision`` for fixed-resolution transformers
towers, ``packed_tower`` for native-resolution ones), the changes speed options make
(``fused_qkv``, ``fused_norm``, ``patch_embedding``, ``gelu_epilogue``, ``aligned_mlp``,
``layout``, ``rewrites``, ``automatic``), family parts (``idefics``, ``mllama``, ``naflex``,
``grid_positions``, ``internvl_tp``), and the version table (``versions``).
"""
