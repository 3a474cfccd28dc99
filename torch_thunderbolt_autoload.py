"""Entry point (a top-level module, so that a disabled autoload imports nothing of ours) for torch's `torch.backends` autoload group (runs at the end of `import torch`).

It only registers the backend name with a lazy creator; it must never make `import torch` fail, so every
error is swallowed with a warning. Disable with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (all plugins) or
THUNDERBOLT_AUTOLOAD=0 (this one).
"""


def autoload() -> None:
    import os

    if os.environ.get("THUNDERBOLT_AUTOLOAD", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        from torch_thunderbolt.backend.registration import register

        register()
    except Exception as exc:  # noqa: BLE001 - a plugin must not break `import torch`
        import warnings

        warnings.warn(f"torch-thunderbolt autoload failed ({exc}); `import torch_thunderbolt` to retry",
                      RuntimeWarning, stacklevel=1)
