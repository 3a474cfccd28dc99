"""Entry point (a top-level module, so that a disabled autoload imports nothing of ours) for torch's `torch.backends` autoload group (runs at the end of `import torch`).

It only registers the backend name with a lazy creator; it must never make `import torch` fail, so every
error is swallowed with a warning. Disable with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (all plugins) or
THUNDERBOLT_AUTOLOAD=0 (this one).
"""


def autoload() -> None:
    import os

    # The values config.parse_autoload reads as "off", checked here first so that a disabled autoload
    # imports nothing of ours; every other value is parsed (and judged) by config.py below.
    if os.environ.get("THUNDERBOLT_AUTOLOAD", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    import warnings

    try:
        from torch_thunderbolt.config import parse_autoload
        from torch_thunderbolt.errors import ConfigError

        try:
            enabled = parse_autoload(os.environ)
        except ConfigError as exc:
            # A value we cannot read (THUNDERBOLT_AUTOLOAD=garbage): raising would break `import torch` for
            # every program in this environment, and guessing "on" would override what was most likely an
            # attempt to switch us off. So: a loud warning naming the variable, and no registration; a job
            # that imports torch_thunderbolt anyway gets this same ConfigError when its group is created
            # (Config.from_env parses THUNDERBOLT_AUTOLOAD too), and `torch-thunderbolt doctor` reports it.
            warnings.warn(f"torch-thunderbolt: {exc}; the 'thunderbolt' backend was NOT registered by "
                          f"`import torch` (set THUNDERBOLT_AUTOLOAD=0 or 1)", RuntimeWarning, stacklevel=1)
            return
        if not enabled:
            return
        from torch_thunderbolt.backend.registration import register

        register()
    except Exception as exc:  # noqa: BLE001 - a plugin must not break `import torch`
        warnings.warn(f"torch-thunderbolt autoload failed ({exc}); `import torch_thunderbolt` to retry",
                      RuntimeWarning, stacklevel=1)
