"""The instance stream: rank publishers, the fan-in, replay, the folded view, subscribers, tail, transport."""
