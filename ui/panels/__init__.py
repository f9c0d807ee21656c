"""The panels the window shows beside the chat: the Monitor drawer's tabs (Backends, Controls,
Routing, Latency, Teaching with its What if, Experiments), what their time plots add
(`plot_marks`), the live run's Pause/Step row and phase strip, the loading screen, and the
presenter view's large type. Each takes the engine and the bridge in its constructor and updates
from the bridge's tick; main thread only."""
