def unavailable(*args, **kwargs):
    raise NotImplementedError("torchvision is a test stub here; image ops are unavailable")


def module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable
