"""The one Keras backend mpitrain.keras supports, checked in one place."""
import keras

SUPPORTED = ("tensorflow",)


def check_backend():
    """Raise one line (RuntimeError) unless Keras runs on a supported backend."""
    name = keras.config.backend()
    if name not in SUPPORTED:
        raise RuntimeError(f"mpitrain.keras supports the Keras backend "
                           f"{' and '.join(SUPPORTED)} only, not {name!r}: set "
                           f"KERAS_BACKEND=tensorflow (for PyTorch use mpitrain.torch)")
