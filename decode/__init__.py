"""decode: the runtime layer (target adapters, vanilla and speculative decoding, CLIs).

Lower layer of the project: it never imports supernet, hwprofile or nas.
"""
