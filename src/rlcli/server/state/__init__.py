"""What the HTTP process keeps: sessions, training clients and sampling sessions
(``sessions.py``), the futures clients poll (``futures.py``) and the handle on the engine process
(``engine_client.py``). No torch is imported here."""
