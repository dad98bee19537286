"""The actors: agents, their mailboxes, tools, respond, rendering, and what a hostile
caller tries."""
