"""Configuration: what a quantization is asked to do.

``quantization`` (the Quark-shaped ``QuantizationConfig`` / ``Config``), ``options`` (every
``extra_options`` key), ``enums`` and ``presets`` (the TOML files in the repository's ``configs/``).
"""
