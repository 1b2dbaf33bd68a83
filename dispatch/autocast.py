"""torch.autocast('neuron', ...): placeholder, filled in below."""


def register(lib) -> None:
    pass
