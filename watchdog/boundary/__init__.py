"""Where something untrusted crosses in or out, each through one primitive: the bounded reader of untrusted
data and of files a rank names (untrusted_data, rank_files), the private-file writer, the secret reader, the
one HTTP client and server and their gate, children run bounded, the privileges the daemon holds and drops,
and what a dump request names (webhook)."""
