"""The thread boundary: the commands the event loop sends the engine thread and the
events it hands back, the engine thread's loop (admission, eviction, restore, commit,
hold and undo), and the ``Scheduler`` actor, the async front. Imports every other
part of the scheduler."""
