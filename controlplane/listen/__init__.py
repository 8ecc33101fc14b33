"""The two listeners' defences: connection limits and deadlines, TLS files and
the web configuration, and page access (users, Host, the admin socket)."""
