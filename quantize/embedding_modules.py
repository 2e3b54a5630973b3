"""TorchRec's names for recship's quantized collections (``torchrec.quant.embedding_modules``).

TorchRec calls its quantized modules ``EmbeddingBagCollection`` and ``EmbeddingCollection``,
the same names as the float ones, telling them apart by module; its tutorials import
``from torchrec.quant.embedding_modules import EmbeddingBagCollection as
QuantEmbeddingBagCollection``. This module gives that import path the same meaning in
recship: the names below ARE ``recship.quantize.QuantEmbeddingBagCollection`` and
``QuantEmbeddingCollection`` (the same classes, not subclasses), so

    quantize_dynamic(model, qconfig_spec={recship.EmbeddingBagCollection: qconfig},
                     mapping={recship.EmbeddingBagCollection: EmbeddingBagCollection})

swaps every float collection for recship's quantized one (``from_float``). Elsewhere
recship uses the unambiguous ``Quant...`` names.
"""

from recship.quantize.modules import QuantEmbeddingBagCollection as EmbeddingBagCollection
from recship.quantize.modules import QuantEmbeddingCollection as EmbeddingCollection

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]
