"""The server: OpenAI's Chat Completions and Anthropic's Messages over HTTP, each session
an agent of a running runtime (``pip install 'mlx-actors[serve]'``).

It sits above the runtime: requests become turns of agents (``Agent.respond``), and
nothing below it knows HTTP. ``python -m mlx_actors serve`` runs it.
"""

from ._app import create_app as create_app
from ._serve import listen as listen
from ._serve import serve as serve
