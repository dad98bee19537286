"""The actors: agents, their mailboxes, tools, respond, rendering, requests given up
(cancellation), bursts, and the direction of their imports."""
