"""Caches out of the pool: a cache as host memory (an image) and back into blocks,
the copies between device and host, and the host tier of evicted caches. Imports
:mod:`..kv`."""

from ._host import HostCaches as HostCaches
from ._image import CacheImage as CacheImage
from ._image import make_blocks as make_blocks
from ._image import take_image as take_image
from ._manager import CacheManager as CacheManager
from ._transfer import host_memory as host_memory
from ._transfer import to_device as to_device
from ._transfer import to_host as to_host
