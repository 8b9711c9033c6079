"""Layer discovery for Hugging Face and user models."""


def find_layers(model, attr=None):  # placeholder until issue 5 lands
    raise NotImplementedError("find_layers is not implemented yet")
