# shellcheck shell=sh
# A single GPU server whose jobs run next to docker bridges: keep NCCL's and gloo's socket
# transports off docker0/br-*/veth* and loopback, which NCCL and gloo may otherwise pick and
# then hang on (other hosts cannot reach those addresses).

# NCCL takes an exclusion list of interface-name prefixes.
site_env_set NCCL_SOCKET_IFNAME '^docker,lo,veth,br-'
# gloo takes exactly one interface name, so the first usable one is chosen at activation time.
if site_env_gloo_if="$(site_env_first_interface)"; then
    site_env_set GLOO_SOCKET_IFNAME "$site_env_gloo_if"
else
    echo "site-env-docker-host: no interface other than loopback and docker bridges in" \
        "${SITE_ENV_NET_DIR:-/sys/class/net}; GLOO_SOCKET_IFNAME left as it was" >&2
fi
unset site_env_gloo_if
