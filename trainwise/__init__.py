"""trainwise. `trainwise.init()` starts (or resumes) a user's own job under trainwise: see
`trainwise.sdk`. It is imported on first use so that `import trainwise.settings` stays light."""

from typing import Any


def init(**options: Any) -> Any:
    from trainwise.sdk import init as sdk_init

    return sdk_init(**options)


def __getattr__(name: str) -> Any:
    if name in ("Run", "Preempted", "Capabilities", "ModelChangedError"):
        import trainwise.sdk as sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'trainwise' has no attribute {name!r}")
