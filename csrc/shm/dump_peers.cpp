// A failing rank has its peers write their flight records too (Note [Every rank dumps]).
#include <signal.h>
#include <unistd.h>

#include "shm/collectives.h"
#include "shm/flight.h"

namespace pycomm::shm {

// Note [Every rank dumps]
// When a group fails on one rank (a timeout, a dead peer, a mismatch), that rank writes its
// flight record, but a rank that is merely late has nothing failing and writes none, so
// the records cannot be compared (torch's analyzer stops at "Missing dump files from
// ranks"). So the failing rank also sends SIGUSR2 to each peer of the group: the signal
// that makes a process write every live group's record (Note [Flight records on a signal]
// in flight.cpp). Only to a peer whose process said, in its RankCtl, that pycomm handles
// that signal there ($PYCOMM_FLIGHT_RECORD_DIR set, no handler of the program's own):
// anywhere else SIGUSR2 would terminate it. The segment is shared by the group's ranks
// alone and each holds its peers' pids already, so no store round trip is needed; the
// peers write within the time a signal takes.
void Channel::set_dumps_on_signal(bool yes) {
  segment_->rank(rank_).dumps_on_signal.store(yes ? 1 : 0, std::memory_order_release);
}

int Channel::signal_peers_to_dump() const {
  int sent = 0;
  for (int r = 0; r < world_; ++r) {
    const RankCtl& peer = segment_->rank(r);
    const int32_t pid = peer.pid.load();
    if (r == rank_ || pid <= 0 || pid == getpid() ||
        peer.dumps_on_signal.load(std::memory_order_acquire) != 1)
      continue;
    if (kill(pid, kFlightDumpSignal) == 0) ++sent;
  }
  return sent;
}

}  // namespace pycomm::shm
