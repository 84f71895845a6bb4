"""``import mpitrain.tensorflow.keras as hvd``: the same module as ``mpitrain.keras``
(horovod.tensorflow.keras's spelling)."""
import sys

import mpitrain.keras as _keras

sys.modules[__name__] = _keras
