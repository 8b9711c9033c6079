"""Weight offloading (docs/design.md 4.10)."""


class WeightOffloader:  # placeholder: not part of this milestone
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("WeightOffloader is not implemented yet")
