"""Agents on several machines or GPUs: a :class:`Cluster` of runtimes on Ray (the
``mlx-actors[ray]`` extra), with the agent API of one runtime. Importing this package
needs Ray; ``mlx_actors`` itself never imports it."""

from ._cluster import Cluster as Cluster
from ._cluster import ClusterStatistics as ClusterStatistics
from ._remote import RemoteAgent as RemoteAgent
from ._remote import RemoteTurnStream as RemoteTurnStream
