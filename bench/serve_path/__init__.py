"""Through a server: what the HTTP and Ray Serve path costs, the routers, multi-turn chat, structured outputs."""
