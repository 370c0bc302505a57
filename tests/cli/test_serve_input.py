"""``rtx serve`` input that makes no sense is refused before anything starts (no model loaded, no port bound): exit
status 2 and one line naming the flag or config key and the value."""

from __future__ import annotations

import pytest

from rtxcore.errors import ConfigError
from rtxcore.files import check_directory_path
from tests.helpers.certs import TestCA
from tests.helpers.cli import assert_one_line_error, config_file, run_in_process

MODEL = ("--model", "dummy:tiny", "--device", "cpu")
# Should a case be accepted after all, the server it starts takes no fixed port.
SERVE = ("serve", *MODEL, "--port", "0", "--no-grpc")
# A tenant the server would accept, but for the setting each case adds.
TENANT = '[tenants.x]\nkey_sha256 = "' + "0" * 64 + '"\n'


@pytest.mark.parametrize(("args", "fragment"), [
    (("--fleet-peers", "a", "--autoscale-lane", "nope"),
     "--autoscale-lane 'nope' is not a lane (lanes: realtime, standard, bulk)"),
    (("--port", "70000"), "argument --port: 70000 is not a port in [0, 65535]"),
    (("--grpc-port", "-1"), "argument --grpc-port: -1 is not a port in [0, 65535]"),
    (("--fleet-peers", ""), "--fleet-peers '' has an empty entry"),
    (("--fleet-peers", "a,,b"), "--fleet-peers 'a,,b' has an empty entry"),
    # The settings' own names (shutdown_grace_s, max_num_seqs...) used to stand for the flags.
    (("--shutdown-grace", "-5"), "--shutdown-grace must be >= 0, got -5"),
    (("--max-body-bytes", "0"), "argument --max-body-bytes: '0' is not at least 1"),
    (("--max-body-bytes", str(2**31)), "argument --max-body-bytes: '2147483648' is more than 2,147,483,647"),
    (("--max-active-requests", "0"), "argument --max-active-requests: '0' is not at least 1"),
    (("--request-timeout", "0"), "--request-timeout must be positive, got 0"),
    (("--max-num-seqs", "-3"), "argument --max-num-seqs: '-3' is not at least 1"),
    (("--num-kv-blocks", "1"), "argument --num-kv-blocks: '1' is not at least 2"),
])
def test_bad_serve_flags_are_named_in_one_line(args, fragment):
    assert_one_line_error(run_in_process(*SERVE, *args), fragment)


@pytest.mark.parametrize(("args", "fragment"), [
    # At 0 an empty journal is "mostly garbage" and was rewritten every 0.2 s.
    (("--journal-compact-bytes", "0"), "--journal-compact-bytes must be at least 64KiB (65536), got 0"),
    (("--journal-compact-bytes", "4KiB"), "--journal-compact-bytes must be at least 64KiB (65536), got 4096"),
])
def test_bad_journal_flags_are_named_in_one_line(tmp_path, args, fragment):
    assert_one_line_error(run_in_process(*SERVE, "--state-dir", str(tmp_path / "state"), *args), fragment)


@pytest.mark.parametrize("flag", [("--journal-retention", "60"), ("--journal-compact-bytes", "1M")])
def test_journal_flags_without_a_state_dir_are_refused_not_ignored(flag):
    assert_one_line_error(run_in_process(*SERVE, *flag), f"{flag[0]} needs --state-dir")


@pytest.mark.parametrize("ca", ["text", "key"])
def test_ca_certs_that_are_not_pem_certificates_are_named_before_grpc_binds(tmp_path, ca):
    # gRPC's C core used to print lines of its own, then the error blamed the port.
    authority = TestCA(tmp_path)
    server = authority.issue("server", {"CN": "127.0.0.1"}, server=True)
    bad = tmp_path / "ca.txt"
    bad.write_bytes(b"not a certificate\n" if ca == "text" else server.key.read_bytes())
    proc = run_in_process("serve", *MODEL, "--port", "0", "--grpc-port", "0", "--ssl-certfile", str(server.cert),
                          "--ssl-keyfile", str(server.key), "--ssl-ca-certs", str(bad))
    assert_one_line_error(proc, f"--ssl-ca-certs {str(bad)!r} is not a file of PEM CA certificates")


def test_kv_disk_dir_may_be_made_but_not_its_missing_parents(tmp_path):
    typo = tmp_path / "nvme0" / "rtx" / "kv"
    assert_one_line_error(run_in_process(*SERVE, "--kv-disk-dir", str(typo)),
                          f"--kv-disk-dir {str(typo)!r}: {typo.parent} does not exist")
    assert not (tmp_path / "nvme0").exists()
    check_directory_path(str(tmp_path / "kv"), "--kv-disk-dir", make_parents=False)  # the last directory alone
    check_directory_path(str(typo), "--state-dir")  # the default still makes a chain
    with pytest.raises(ConfigError, match="is a file"):
        check_directory_path(f"{__file__}/kv", "--kv-disk-dir", make_parents=False)


@pytest.mark.parametrize(("text", "fragment"), [
    (TENANT + "max_concurrency = 1.5", "[tenants.x] max_concurrency must be a positive integer, got 1.5"),
    (TENANT + "max_concurrency = 0", "[tenants.x] max_concurrency must be a positive integer, got 0"),
    (TENANT + "tokens_per_minute = 1000.0", "[tenants.x] tokens_per_minute must be a positive integer, got 1000.0"),
    (TENANT + "requests_per_second = 1\nburst = true", "[tenants.x] burst must be a positive integer, got True"),
    (TENANT + "requests_per_second = true", "[tenants.x] requests_per_second must be a positive number, got True"),
    (TENANT + "burst = 4", "[tenants.x] burst needs requests_per_second"),
    # Lanes were already strict; kept so.
    ("[lanes.bulk]\nmax_queue = 1.5", "[lanes.bulk] max_queue must be an integer >= 1, got 1.5"),
    ("[lanes.bulk]\nmax_wait_s = true", "[lanes.bulk] max_wait_s must be a positive number of seconds, got True"),
])
def test_tenant_and_lane_counts_are_positive_integers(tmp_path, text, fragment):
    assert_one_line_error(run_in_process(*SERVE, "--config", config_file(tmp_path, text)), fragment)


def test_state_dir_may_be_made_but_not_its_missing_parents(tmp_path):
    """A typo in a mount point used to put the journal on the container's own disk without a word."""
    typo = tmp_path / "mnt" / "stat" / "rtx"
    assert_one_line_error(run_in_process(*SERVE, "--state-dir", str(typo)),
                          f"--state-dir {str(typo)!r}: {typo.parent} does not exist (only the last directory is made")
    assert not typo.parent.exists()


@pytest.mark.parametrize(("text", "fragment"), [
    ("[brownout]\nenter_presure = 1.0\n", "unknown setting 'enter_presure' in [brownout]"),
    ("[brownout]\nmax_level = 99\n", "max_level"),
    ("[scheduler]\nmerge_windows = 0.01\n", "unknown sla-lanes option 'merge_windows'"),
    ("[scheduler]\nmerge_window_s = -1\n", "merge_window_s must be >= 0"),
])
def test_scheduler_and_brownout_settings_fail_before_the_model_is_looked_for(tmp_path, text, fragment):
    """They were read by the scheduler when the engine was built: after the weights had loaded, with /health
    answering 200 meanwhile. The model named here does not exist: its error would come first if they still did."""
    proc = run_in_process("serve", "--model", str(tmp_path / "missing.gguf"), "--scheduler", "sla-lanes",
                          "--config", config_file(tmp_path, text), "--port", "0", "--no-grpc")
    assert_one_line_error(proc, fragment)
