"""The simulated agent scenario: tool-use tasks through the live stack (``online-sao agent``)."""
