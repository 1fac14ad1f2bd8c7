"""benchmark owners: a benchmark series belongs to a namespace, like a run

``benchmark_series.owner_key`` ('team:<team>', 'token:<id>', or '' for series recorded without a token
or before owners existed) is part of a series' identity: a team's points for a cluster go to its own
series, so no other token writes into them, and a reader with a team sees its team's series
(server/reports/scope.py).

Revision ID: 0018
Revises: 0017
"""
from alembic import op
import sqlalchemy as sa

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('benchmark_series', sa.Column('owner_key', sa.Text(), nullable=False, server_default=''))
    op.drop_constraint('uq_benchmark_series_name_cluster_params_key', 'benchmark_series', type_='unique')
    op.create_unique_constraint('uq_benchmark_series_owner_name_cluster_params_key', 'benchmark_series',
                                ['owner_key', 'name', 'cluster', 'params_key'])


def downgrade() -> None:
    op.drop_constraint('uq_benchmark_series_owner_name_cluster_params_key', 'benchmark_series', type_='unique')
    op.create_unique_constraint('uq_benchmark_series_name_cluster_params_key', 'benchmark_series',
                                ['name', 'cluster', 'params_key'])
    op.drop_column('benchmark_series', 'owner_key')
