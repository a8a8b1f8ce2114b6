-- A replica's answer to another replica's quiesce of a sandbox about to
-- freeze for a move: the token of the move's lease, written with the
-- replica's traffic row once every proxy watching it has dropped the
-- sandbox's route and counted what it still has open (0: no answer).
ALTER TABLE sandbox_activity ADD COLUMN quiesce_token BIGINT NOT NULL DEFAULT 0;
