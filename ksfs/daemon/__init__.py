"""The mount daemon: control socket server and client, and the process that runs the mount."""
