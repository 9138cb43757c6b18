from .._stub import module_getattr, unavailable

pil_to_tensor = to_tensor = resize = normalize = unavailable


def __getattr__(name: str):
    if name == "InterpolationMode":
        from . import InterpolationMode

        return InterpolationMode
    return module_getattr(name)
